"""The features around the stages, each against DDP (bitwise, world size 2) where it trains:
activation checkpointing, a unit called twice, a first unit whose input needs no gradient,
a parameter used on one rank only, frozen and unused parameters, names and local pieces,
full_state_dict, world size 1, mixed-precision dtypes."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zero
from compare import System, first_difference, make_optimizer, run_and_compare
from conftest import sample
from harness import run_ranks
from zerolab.models import GPT, Block, UnevenMLP


class CheckpointedBlock(Block):
    def forward(self, x):  # recomputed in backward, inside the unit
        return checkpoint(super().forward, x, use_reentrant=False)


class GPTVariant(GPT):
    """mode: "ac_inside" (checkpoint inside each unit), "ac_outside" (checkpoint(unit, x)),
    "ac_reentrant" (the same with the reentrant implementation, whose first pass runs
    under no_grad), "twice" (the first block is called twice in one forward)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        if mode == "ac_inside":
            self.blocks = nn.ModuleList(CheckpointedBlock(self.cfg) for _ in self.blocks)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if self.mode.startswith("ac_") and self.mode != "ac_inside":
                x = checkpoint(block, x, use_reentrant=self.mode == "ac_reentrant")
            else:
                x = block(block(x)) if (self.mode == "twice" and i == 0) else block(x)
        return self.head(self.ln_f(x))


class Stack(nn.Module):
    """Three units in a row; the first one's input is the data, which needs no gradient.
    ``rank0_only`` is used on rank 0 only: same unit, different use per rank."""

    has_unused_parameters = True

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(11, 11), nn.Tanh()) for _ in range(3))
        self.rank0_only = nn.Linear(11, 11)
        self.head = nn.Linear(11, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if dist.get_rank() == 0:
            x = x + self.rank0_only(x)
        return self.head(x)

    def units(self):
        return [*self.layers, self]

    def batch(self, b, gen):
        return torch.randn(b, 11, generator=gen), torch.randn(b, 3, generator=gen)

    @staticmethod
    def loss(out, y):
        return F.mse_loss(out, y)


def _against_ddp(rank, n, make, kinds):
    torch.manual_seed(0)
    base = make()
    systems = [System("ddp", base, "adamw")] + [System(k, base, "adamw") for k in kinds]
    failures = []

    def check(step, systems, outs):
        ref = systems[0].full_params()
        for s in systems[1:]:
            if (diff := first_difference(s.full_params(), ref)) is not None:
                failures.append(f"{s.kind} after step {step}: {diff}")

    with zero.Ledger() as ledger:
        run_and_compare(rank, systems, 3, check)
    return failures, [(r.op, r.unit, r.phase) for r in ledger.records]


@pytest.mark.parametrize("mode", sample(["ac_reentrant", "twice"], ["ac_inside", "ac_outside", "ac_reentrant", "twice"]))
def test_checkpointing_and_a_unit_called_twice_match_ddp(mode):
    failures, records = run_ranks(_against_ddp, 2, lambda: GPTVariant(mode),
                                  ["zero1", "zero2", "zero3", "fsdp2"])[0]
    assert failures == []
    forward = [r for r in records if r[0] == "all_gather" and r[2] == "forward"]
    per_step = len(forward) / 3
    assert per_step == (4 if mode == "twice" else 3)  # stage 3: block 0 gathered twice


def test_first_unit_without_input_grad_and_rank_dependent_use_match_ddp():
    failures, records = run_ranks(_against_ddp, 2, Stack, ["zero1", "zero2", "zero3"])[0]
    assert failures == []
    reduced = [r[1] for r in records if r[0] == "reduce_scatter"]
    assert reduced.count("layers.0") == 3 * 3  # 3 steps x 3 stages: the first unit too


def _frozen_and_unused(rank, n, stage):
    torch.manual_seed(0)
    model = UnevenMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for unit in model.units():
        zero.shard(unit, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    model.loss(model(x), y).backward()
    grads = {name: p.grad is not None for name, p in model.named_parameters()}
    requires = {name: p.requires_grad for name, p in model.named_parameters()}
    opt.step()
    after = zero.full_state_dict(model)
    return grads, requires, {k: torch.equal(before[k], after[k]) for k in after}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_and_unused_parameters_get_no_gradient_and_do_not_move(stage):
    grads, requires, unchanged = run_ranks(_frozen_and_unused, 2, stage)[0]
    for name in grads:
        idle = name.startswith(("frozen.", "unused."))
        assert grads[name] == (not idle), name  # None exactly for frozen and unused
        assert unchanged[name] == idle, name  # no update, not even weight decay
        assert requires[name] == (not name.startswith("frozen.")), name


def _pieces(rank, n, stage):
    torch.manual_seed(0)
    model = GPT()
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for unit in model.units():
        zero.shard(unit, stage=stage)
    out = {}
    for name, p in model.named_parameters():
        unit, piece = zero.unit_of(p), zero.piece_of(p)
        lo = piece.param_offset if piece else 0
        inside = p.numel() == 0 or (
            unit.sharded.data_ptr() <= p.data_ptr() < unit.sharded.data_ptr() + 4 * unit.sharded.numel())
        out[name] = (lo, p.detach().clone(), p.dim() == 1 and inside)
    sd = zero.full_state_dict(model)
    same = list(sd) == list(state) and all(torch.equal(sd[k], state[k]) for k in state)
    return out, {k: v for k, v in full.items()}, same


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 3])
def test_names_hold_local_pieces_that_tile_each_parameter(stage, n):
    results = run_ranks(_pieces, n, stage)
    full = results[0][1]
    for name, value in full.items():
        pieces = sorted((r[0][name] for r in results), key=lambda t: t[0])
        assert all(view_ok for _, _, view_ok in pieces), name  # 1-D views into the shard
        assert torch.equal(torch.cat([t for _, t, _ in pieces]), value.reshape(-1)), name
    assert "head.weight" not in full  # tied: one parameter, under its first name
    assert all(r[2] for r in results)  # full_state_dict == the unsharded state_dict()


def _world_size_one(rank, n):
    torch.manual_seed(0)
    base = GPT()
    ref = copy.deepcopy(base)
    ref_opt = make_optimizer("adamw", list(ref.named_parameters()))
    systems = [System(k, base, "adamw") for k in ("zero1", "zero2", "zero3")]
    bad = []
    for step in range(3):
        x, y = base.batch(4, torch.Generator().manual_seed(1000 * step))
        base.loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for s in systems:
            s.step(rank, step)
            if first_difference(s.full_params(), dict(ref.named_parameters())) is not None:
                bad.append((s.kind, step))
    return bad


def test_world_size_one_equals_plain_training():
    assert run_ranks(_world_size_one, 1) == [[]]


def _mixed_precision_dtypes(rank, n, stage):
    torch.manual_seed(0)
    model = UnevenMLP()
    seen = []
    model.inp.register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, m.weight.dtype)))
    for unit in model.units():
        zero.shard(unit, stage=stage, mp_policy=zero.MixedPrecision(torch.bfloat16, torch.float32))
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    out = model(x)
    model.loss(out, y).backward()
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return seen, out.dtype, {p.dtype for p in model.parameters()}, grads


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards(stage):
    seen, out_dtype, param_dtypes, grad_dtypes = run_ranks(_mixed_precision_dtypes, 2, stage)[0]
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # input cast; gathered weight in bf16
    assert out_dtype == torch.bfloat16
    assert param_dtypes == {torch.float32} and grad_dtypes == {torch.float32}


class WithBuffers(nn.Module):
    """A fixed buffer used in forward and a BatchNorm (running statistics are buffers too)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 9))
        self.inp = nn.Linear(9, 9)
        self.norm = nn.BatchNorm1d(9)
        self.out = nn.Linear(9, 2)

    def forward(self, x):
        return self.out(self.norm(self.inp(x * self.scale)))

    def units(self):
        return [self.inp, self]

    def batch(self, b, gen):
        return torch.randn(b, 9, generator=gen), torch.randn(b, 2, generator=gen)

    @staticmethod
    def loss(out, y):
        return F.mse_loss(out, y)


def _buffers(rank, n):
    failures, _ = _against_ddp(rank, n, WithBuffers, ["zero1", "zero2", "zero3"])
    torch.manual_seed(0)
    model = WithBuffers()
    for unit in model.units():
        zero.shard(unit, stage=3)
    names = dict(model.named_buffers())
    whole = names["scale"].shape == (9,) and names["norm.running_mean"].shape == (9,)
    return failures, whole, sorted(names)


def test_buffers_stay_whole_and_replicated_and_training_matches_ddp():
    failures, whole, names = run_ranks(_buffers, 2)[0]
    assert failures == [] and whole
    assert names == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var", "scale"]
