"""The calling patterns of real model code (transformers, torchtitan), each against a reference.

Every case here was once a silent wrong result: checkpointing called inside a unit's
``forward``, ``no_sync`` on part of a model, bf16 gradient accumulation, units whose inputs
and outputs are dataclasses, parameters unfrozen after sharding, a backward that raised,
tied weights in two forwards before one backward, a module that casts its own weights.
World size 2, fp32 unless stated, ``torch.equal`` after every step. The reference is DDP
where DDP runs the pattern, "replicated" (plain PyTorch, each gradient averaged: what DDP
computes) where it does not, and FSDP2 where only FSDP2 has the same feature.
"""

import contextlib
import gc
import os
import weakref
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zero
from zero.comm import Disagreement
from compare import (DIM, ZERO, Net, System, Tanh, batch_of, compare, inner,
                     max_relative_difference)
from conftest import sample
from harness import run_ranks
from zerolab.measure import CommBytes
from zerolab.models import GPT, GPTConfig, LoRAStack
from zerolab.systems import average_gradients


# ---- 1. activation checkpointing called inside a unit's forward (transformers 5) ------------

class CheckpointInside(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(lambda t: torch.tanh(self.lin(t)) * self.scale, x,
                          use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_called_inside_forward_matches_ddp(reentrant):
    make = lambda: Net([CheckpointInside(reentrant) for _ in range(2)])  # noqa: E731
    assert run_ranks(compare, 2, make, "ddp", ZERO + ["fsdp2"]) == [[], []]


# ---- 2./3. no_sync on part of a model; bf16 accumulation ------------------------------------

@contextlib.contextmanager
def _no_sync(sys_, module):
    if sys_.kind.startswith("fsdp2"):
        module.set_requires_gradient_sync(False)
        yield
        module.set_requires_gradient_sync(True)
    else:
        with zero.no_sync(module):
            yield


def _partial_no_sync_step(sys_, rank, step, micro=3):
    """Micro-batches 0..micro-2 skip the gradient sync of the first block only."""
    model = sys_.model
    for m in range(micro):
        x, y = batch_of(sys_, rank, step, m)
        last = m == micro - 1
        with contextlib.nullcontext() if last else _no_sync(sys_, model.blocks[0]):
            sys_.base.loss(model(x), y).backward()
    sys_.opt.step()
    sys_.opt.zero_grad()


@pytest.mark.parametrize("mp", sample([True], [False, True]))
def test_no_sync_on_a_submodule_matches_fsdp2(mp):
    opts = {"step": _partial_no_sync_step, "mp": mp}
    assert run_ranks(compare, 2, GPT, "fsdp2", ZERO, opts) == [[], []]


def test_bf16_gradient_accumulation_happens_in_reduce_dtype_like_fsdp2():
    step = lambda sys_, rank, s: sys_.step(rank, s, micro=4)  # noqa: E731
    assert run_ranks(compare, 2, GPT, "fsdp2", ZERO, {"step": step, "mp": True}) == [[], []]


# ---- 4. inputs and outputs in dataclasses -----------------------------------------------------

@dataclass
class Hidden:
    states: torch.Tensor
    scale: float = 1.0


class DataclassBlock(Tanh):
    def forward(self, h: Hidden) -> Hidden:
        return Hidden(torch.tanh(self.lin(h.states)) * h.scale + h.states, h.scale)


class DataclassNet(Net):
    def forward(self, x):
        h = Hidden(self.inp(x), 0.5)
        for block in self.blocks:
            h = block(h)
        return self.out(h.states)


def _dataclass_net():
    return DataclassNet([DataclassBlock() for _ in range(3)])


def test_dataclass_inputs_and_outputs_match_ddp_and_fsdp2():
    assert run_ranks(compare, 2, _dataclass_net, "ddp", ZERO + ["fsdp2"]) == [[], []]


def test_dataclass_inputs_are_cast_like_fsdp2_in_bf16():
    assert run_ranks(compare, 2, _dataclass_net, "fsdp2", ZERO, {"mp": True}) == [[], []]


class Box:
    """A container that no tree walk knows: the unit's output is invisible to zero."""

    def __init__(self, t):
        self.t = t


class BoxBlock(Tanh):
    def forward(self, x):
        return Box(torch.tanh(self.lin(x)))


class BoxNet(Net):
    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x).t
        return self.out(x)


def _hidden_output(rank, n):
    torch.manual_seed(0)
    model = BoxNet([BoxBlock() for _ in range(2)])
    for unit in model.units():
        zero.shard(unit, stage=3)
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    loss = model.loss(model(x), y)
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_backward_through_a_freed_unit_raises_instead_of_reading_freed_memory():
    # (blocks.1 is gathered all the same: the root's backward prefetches it, in FSDP2's
    # order, and the guard waits for that gather before backward reads it; blocks.0 is not)
    for error in run_ranks(_hidden_output, 2):
        assert error is not None and "blocks.0" in error and "was freed" in error, error
        assert "reshard_after_forward=False" in error, error


# ---- 5. parameters frozen at shard time, unfrozen later ---------------------------------------

def _unfreeze_step(sys_, rank, step):
    if step == 1:
        inner(sys_).blocks[1].requires_grad_(True)
    sys_.step(rank, step)


def _frozen_block():
    net = Net([Tanh() for _ in range(3)])
    net.blocks[1].requires_grad_(False)
    return net


def test_a_unit_unfrozen_after_sharding_trains_like_plain_pytorch():
    opts = {"step": _unfreeze_step}
    assert run_ranks(compare, 2, _frozen_block, "replicated", ZERO + ["fsdp2"], opts) == [[], []]


def test_freezing_after_sharding_stops_training_like_plain_pytorch():
    def step(sys_, rank, s):
        if s == 1:
            inner(sys_).blocks[0].lin.weight.requires_grad_(False)
        sys_.step(rank, s)

    make = lambda: Net([Tanh() for _ in range(2)])  # noqa: E731
    assert run_ranks(compare, 2, make, "replicated", ZERO + ["fsdp2"], {"step": step}) == [[], []]


# ---- 6. a forward or backward that raises part-way --------------------------------------------

class Injected(Exception):
    pass


class Failing(Tanh):
    fail = None  # "forward" or "backward": raise there, once

    def forward(self, x):
        if self.fail == "forward":
            raise Injected("forward")
        y = torch.tanh(self.lin(x))
        if self.fail == "backward":
            y.register_hook(lambda g: (_ for _ in ()).throw(Injected("backward")))
        return y


def _failing_step(where):
    def step(sys_, rank, s):
        failing = inner(sys_).blocks[1]
        failing.fail = where if s == 1 else None
        try:
            sys_.step(rank, s)
        except Injected:
            sys_.opt.zero_grad()  # what a training loop that catches the error does
        failing.fail = None
    return step


@pytest.mark.filterwarnings("ignore:the previous")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_iteration_after_a_raising_forward_or_backward_trains_correctly(where):
    make = lambda: Net([Tanh(), Failing(), Tanh()])  # noqa: E731
    opts = {"steps": 4, "step": _failing_step(where)}
    assert run_ranks(compare, 2, make, "replicated", ZERO, opts) == [[], []]


# ---- 7. full_state_dict has every key of the unsharded state_dict ----------------------------

class WithBuffers(GPT):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(self.cfg.dim)
        self.register_buffer("persistent", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _state_dict_keys(rank, n, stage):
    torch.manual_seed(0)
    model = WithBuffers()
    plain = WithBuffers()
    plain.load_state_dict(model.state_dict())
    expected = plain.state_dict()
    for unit in model.units():
        zero.shard(unit, stage=stage)
    full = zero.full_state_dict(model)
    same = all(k in full and torch.equal(full[k], expected[k]) for k in expected)
    plain.load_state_dict(full, strict=True)
    return list(full), list(expected), same


@pytest.mark.parametrize("stage", [1, 3])
def test_full_state_dict_has_the_keys_of_the_unsharded_state_dict(stage):
    full, expected, same = run_ranks(_state_dict_keys, 2, stage)[0]
    assert full == expected and same
    assert "head.weight" in full and "norm.running_mean" in full and "scratch" not in full


# ---- 8. two forwards before one backward, with tied weights -----------------------------------

def _two_forwards(sys_, rank, step):
    (x1, y1), (x2, y2) = batch_of(sys_, rank, step, 0), batch_of(sys_, rank, step, 1)
    loss = sys_.base.loss(sys_.model(x1), y1) + sys_.base.loss(sys_.model(x2), y2)
    loss.backward()
    sys_.opt.step()
    sys_.opt.zero_grad()


def test_two_forwards_before_one_backward_with_tied_weights_match_ddp():
    assert run_ranks(compare, 2, GPT, "ddp", ZERO + ["fsdp2"], {"step": _two_forwards}) == [[], []]


# ---- 9. world size 1: no collective at all ----------------------------------------------------

def _world_size_one_traffic(rank, n, stage):
    torch.manual_seed(0)
    with zero.Ledger() as ledger:
        model = GPT()
        for unit in model.units():
            zero.shard(unit, stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(s):
            x, y = model.batch(4, torch.Generator().manual_seed(s))
            model.loss(model(x), y).backward()
            zero.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()

        step(0)
        with CommBytes() as comm:  # torch's count, from the dispatcher: nothing escapes it
            step(1)
        zero.full_state_dict(model)
    return len(ledger.records), dict(comm.calls)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_one_issues_no_collective(stage):
    assert run_ranks(_world_size_one_traffic, 1, stage) == [(0, {})]


# ---- 10. a module that casts its own weights in forward (Switch's router) ----------------------

class Router(nn.Module):
    """Computes in fp32 whatever the model's dtype, as Switch Transformers' router does."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(DIM, 2, bias=False)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(x.to(torch.float32)).softmax(-1)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x):
        probs = self.router(x)
        return sum(probs[..., i : i + 1] * e(x) for i, e in enumerate(self.experts)).to(x.dtype)


class RouterNet(Net):
    def __init__(self, router_unit: bool):
        super().__init__([MoE(), MoE()])
        self.router_unit = router_unit

    def units(self):
        return [*self.fp32_units(), *self.blocks, self]

    def fp32_units(self):
        """Units that keep computing in fp32 under a bf16 policy (zerolab.systems.System)."""
        return [b.router for b in self.blocks] if self.router_unit else []


def _router_in_bf16_unit(rank, n, stage):
    torch.manual_seed(0)
    model = RouterNet(router_unit=False)
    for unit in model.units():
        zero.shard(unit, stage=stage, mp_policy=zero.MixedPrecision(torch.bfloat16, torch.float32))
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    try:
        model.loss(model(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_casting_its_own_weights_in_a_bf16_unit_raises_naming_the_fix(stage):
    for error in run_ranks(_router_in_bf16_unit, 2, stage):
        assert error is not None and "blocks.0.router.classifier" in error, error
        assert "its own unit" in error, error


def test_the_fix_a_router_as_its_own_fp32_unit_matches_fsdp2():
    make = lambda: RouterNet(router_unit=True)  # noqa: E731
    assert run_ranks(compare, 2, make, "fsdp2", ZERO, {"mp": True}) == [[], []]


# ---- frozen base weights, trainable adapters (LoRA): stage 3 frees each block on time -------

def test_lora_style_fine_tuning_matches_ddp_and_fsdp2():
    # Each block's backward ends with the hook on its inputs' gradients (zero/core/hooks.py): the
    # extra autograd node must not change a single bit.
    make = lambda: LoRAStack(dim=32, blocks=3, rank=4)  # noqa: E731
    assert run_ranks(compare, 2, make, "ddp", ZERO + ["fsdp2"]) == [[], []]


# ---- found in review: a unit's gradient in two parts, or in another order on each rank ------

def _in_mode(rank, n, check, fn, *args):
    """Run ``fn`` with check mode (ZERO_CHECK) on or off: the tests run with it on, and it
    raises at the first collective that differs, so a default-mode bug would hide behind it."""
    os.environ["ZERO_CHECK"] = check
    return fn(rank, n, *args)


class SharedTwice(Net):
    """A weight-shared block applied twice, each call checkpointed (reentrant): each
    recompute runs a backward of its own, so the unit's gradient arrives in two parts."""

    def forward(self, x):
        x = self.inp(x)
        for block in (self.blocks[0], self.blocks[1], self.blocks[1]):
            x = checkpoint(block, x, use_reentrant=True)
        return self.out(x)


class TwoPiecesInside(Tanh):
    """A unit whose own forward checkpoints two pieces (reentrant): the first piece's backward
    completes the unit's gradient while the second piece has yet to recompute."""

    def forward(self, x):
        for _ in range(2):
            x = checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=True)
        return x


def _two_parts(rank, n, make):
    torch.manual_seed(0)
    base = make()
    systems = [System(k, base, "adamw") for k in ["replicated", *ZERO]]
    worst = []
    for s in range(3):
        for sys_ in systems:
            sys_.step(rank, s)
        ref = systems[0].full_params()
        worst.append([max_relative_difference(sys_.full_params(), ref) for sys_ in systems[1:]])
    return worst


@pytest.mark.parametrize("check,model", sample(
    [("0", "shared"), ("1", "inside")], [(c, m) for c in "01" for m in ("shared", "inside")]))
def test_a_unit_whose_gradient_arrives_in_two_parts_keeps_both(check, model):
    # Each part is reduced as it arrives and the means are added, as FSDP2 adds reductions
    # into .grad. mean(a) + mean(b) rounds differently from DDP's mean(a + b)
    # (notes/12-model-code.md): an ulp or two, not a lost part (1e-2). "inside": the second
    # piece recomputes after the first piece's backward completed the unit's gradient.
    make = {"shared": lambda: SharedTwice([Tanh(), Tanh()]),
            "inside": lambda: Net([Tanh(), TwoPiecesInside(), Tanh()])}[model]
    for worst in run_ranks(_in_mode, 2, check, _two_parts, make):
        assert max(max(step) for step in worst) < 1e-6, worst


class Skippable(Tanh):
    skip = False

    def forward(self, x):
        return x if self.skip else torch.tanh(self.lin(x))


def _skip_in_the_synced_micro_batch(sys_, rank, step):
    """Micro-batch 0 (no_sync) uses every block; micro-batch 1 (synced) skips blocks[1]."""
    skippable = inner(sys_).blocks[1]
    for m in range(2):
        x, y = batch_of(sys_, rank, step, m)
        skippable.skip = m == 1
        with sys_.no_sync() if m == 0 else contextlib.nullcontext():
            sys_.base.loss(sys_.model(x), y).backward()
    if sys_.kind == "replicated":
        average_gradients(sys_.model)
    sys_.opt.step()
    sys_.opt.zero_grad()


@pytest.mark.parametrize("ref,mp,check", sample(
    [("replicated", False, "0"), ("fsdp2", True, "1")],
    [("replicated", False, "0"), ("replicated", False, "1"), ("fsdp2", False, "1"), ("fsdp2", True, "1")]))
def test_a_unit_used_only_in_no_sync_micro_batches_is_reduced_at_the_last(ref, mp, check):
    make = lambda: Net([Tanh(), Skippable(), Tanh()])  # noqa: E731
    opts = {"step": _skip_in_the_synced_micro_batch, "mp": mp}
    assert run_ranks(_in_mode, 2, check, compare, make, ref, ZERO, opts) == [[], []]


class RankOrder(Net):
    """Two blocks of the same size, run in an order that depends on the rank (routing)."""

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks if dist.get_rank() == 0 else reversed(self.blocks):
            x = block(x)
        return self.out(x)


class RankOrderTwice(Net):
    """The same, with blocks[1] run twice, each call under reentrant checkpointing."""

    def forward(self, x):
        a, b = self.blocks
        x = self.inp(x)
        for block in (a, b, b) if dist.get_rank() == 0 else (b, a, b):
            x = checkpoint(block, x, use_reentrant=True)
        return self.out(x)


def _rank_order_at_stage_1(rank, n):
    torch.manual_seed(0)
    ddp = compare(rank, n, lambda: RankOrder([Tanh(), Tanh()]), "ddp", ["zero1"])
    base = RankOrderTwice([Tanh(), Tanh()])
    ref, ours = System("replicated", base, "adamw"), System("zero1", base, "adamw")
    worst = 0.0
    for s in range(3):
        ref.step(rank, s)
        ours.step(rank, s)
        worst = max(worst, max_relative_difference(ours.full_params(), ref.full_params()))
    return ddp, worst


@pytest.mark.parametrize("check", ["0", "1"])
def test_units_in_another_order_on_each_rank_train_like_ddp_at_stage_1(check):
    # Stage 1 starts its reductions in a fixed order, as DDP starts its buckets; a gradient in
    # two parts (the second block) adds the two means, to an ulp of DDP's arithmetic (above).
    for ddp, worst in run_ranks(_in_mode, 2, check, _rank_order_at_stage_1):
        assert ddp == [] and worst < 1e-6, (ddp, worst)


def _rank_order_raises(rank, n, kind):
    torch.manual_seed(0)
    sys_ = System(kind, RankOrder([Tanh(), Tanh()]), "adamw")
    try:
        for s in range(2):
            sys_.step(rank, s)
    except Disagreement as e:
        return s, "order" in str(e) or "reduce" in str(e)
    return None


@pytest.mark.parametrize("kind,check,step", sample(
    [("zero2", "0", 1), ("zero3", "1", 0)],
    [(k, c, s) for k in ("zero2", "zero3") for c, s in (("0", 1), ("1", 0))]))
def test_units_in_another_order_on_each_rank_raise_at_stages_2_and_3(kind, check, step):
    # Stage 2 starts each reduce-scatter as a gradient completes, stage 3 also gathers each
    # unit as it runs (both as FSDP2): in another order on each rank the collectives pair up
    # wrongly and the first step is wrong. Check mode raises at the first such collective;
    # without it, the next forward's agreement raises, on every rank, before a second step.
    assert run_ranks(_in_mode, 2, check, _rank_order_raises, kind) == [(step, True)] * 2


def _deleted_models(rank, n):
    """Train a model, delete it, build the next (a sweep, a learning-rate finder), in one
    process; a collector pass runs inside the next model's step (as one may at any
    allocation), while torch walks its optimizer hooks."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    before, out = len(hooks), []
    collect = register_optimizer_step_pre_hook(
        lambda *args: [gc.collect(), None][1])
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8))
        for unit in model.units():
            zero.shard(unit, stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for s in range(2):
            x, y = model.batch(2, torch.Generator().manual_seed(rank + s))
            model.loss(model(x), y).backward()
            opt.step()  # (the collector runs here, while the last model's root may die)
            opt.zero_grad()
        out.append([weakref.ref(u) for u in zero.units_of(model)])
        del model, opt, unit  # (collected in the next model's step, if not before)
    collect.remove()
    gc.collect()
    return [sum(u() is not None for u in units) for units in out], len(hooks) - before


def test_a_deleted_model_is_freed_even_while_another_optimizer_steps():
    """A sharded model, once deleted, gives its shards back: every unit is collected, at
    every stage, even while another model's optimizer steps. (The hook on each unit's flat
    leaf held the unit, out of the collector's reach: a trained model was never freed; and
    a listener per model, removed with it, raised inside another optimizer's step.)"""
    for alive, watches in run_ranks(_deleted_models, 2):
        assert alive == [0, 0, 0] and watches <= 1, (alive, watches)  # (the process's watch)
