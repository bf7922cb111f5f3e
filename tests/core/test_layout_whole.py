"""layout="whole": optimizers that read a whole tensor train as on DDP; elsewhere they are refused.

Adafactor factors the second moment of each matrix, Muon orthogonalises each matrix's update:
on a piece of a parameter they compute something else. With each parameter whole on one rank,
the owner's optimizer sees the whole averaged gradient, in the parameter's shape. At world size
2 that is DDP's training bit for bit (the mean of two gradients does not depend on the order
of the sum); at 3 the mean itself is summed in another order than DDP's bucket (as for every
layout: notes/07-equality.md), so there the test holds the step itself: the owner's update is
bitwise the same optimizer's on the whole tensor, given the same gradient.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from compare import GPT, UnevenMLP
from conftest import sample
from harness import run_ranks
from zerolab.models import GPTConfig

MODELS = {"gpt": lambda: GPT(GPTConfig()), "mlp": UnevenMLP}


def _optimizers(model, kind):
    params = list(model.parameters())
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)]
    if kind == "muon":  # as Muon is used: on the matrices, AdamW on everything else
        return [torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-2),
                torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2)]
    return [torch.optim.AdamW(params, lr=1e-2)]


def _train(rank, n, model, stage, kind, steps=3):
    torch.manual_seed(0)
    base = MODELS[model]()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=getattr(base, "has_unused_parameters",
                                                                  False))
    ours = copy.deepcopy(base)
    for unit in ours.units():
        zero.shard(unit, stage=stage, layout="whole")
    ref_opts, opts = _optimizers(ddp, kind), _optimizers(ours, kind)
    for s in range(steps):
        x, y = base.batch(4, torch.Generator().manual_seed(10 * s + rank))
        base.loss(ddp(x), y).backward()
        base.loss(ours(x), y).backward()
        for opt in ref_opts + opts:
            opt.step()
            opt.zero_grad()
    full = zero.full_state_dict(ours)
    return all(torch.equal(full[k], p) for k, p in ddp.module.named_parameters())


@pytest.mark.parametrize("kind", ["adafactor", "muon", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_whole_trains_like_ddp_at_world_size_2(kind, stage):
    assert all(run_ranks(_train, 2, "mlp", stage, kind))


@pytest.mark.parametrize("kind", ["adafactor", "muon"])
def test_whole_trains_a_gpt_like_ddp(kind):
    assert all(run_ranks(_train, 2, "gpt", 3, kind))


def _one_step_is_the_whole_tensors(rank, n, stage, kind):
    """Gradients as the mechanism reduced them; the update against the optimizer's own on a
    plain copy of the whole tensors, given those gradients: bitwise."""
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    ours = copy.deepcopy(base)
    for unit in ours.units():
        zero.shard(unit, stage=stage, layout="whole")
    opts = _optimizers(ours, kind)
    x, y = base.batch(4, torch.Generator().manual_seed(rank))
    base.loss(ours(x), y).backward()
    plain = copy.deepcopy(base)  # every rank: the whole model, fed the reduced gradients
    owned = {}
    for (name, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters()):
        if p.numel():  # this rank owns it
            q.grad, owned[name] = p.grad.clone(), q
    ref_opts = _optimizers(plain, kind)
    for opt in opts + ref_opts:
        opt.step()
    return all(torch.equal(p, owned[name]) for name, p in ours.named_parameters() if p.numel())


@pytest.mark.parametrize("kind", ["adafactor", "muon"])
def test_at_world_size_3_the_owner_steps_the_whole_tensor(kind):
    assert all(run_ranks(_one_step_is_the_whole_tensors, 3, 3, kind))


def _refused(rank, n, layout, kind):
    torch.manual_seed(0)
    model = UnevenMLP()
    for unit in model.units():
        zero.shard(unit, stage=3, layout=layout)
    try:
        opts = _optimizers(model, kind)
        x, y = model.batch(4, torch.Generator().manual_seed(rank))
        model.loss(model(x), y).backward()
        for opt in opts:
            opt.step(lambda: model.loss(model(x), y)) if kind == "lbfgs" else opt.step()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "trained"


def _lbfgs(model, kind):
    return [torch.optim.LBFGS(model.parameters())]


@pytest.mark.parametrize("layout", ["flat", "rows"])
def test_adafactor_is_refused_where_it_would_see_parts_naming_whole(layout):
    message = run_ranks(_refused, 2, layout, "adafactor")[0]
    assert "reads each parameter whole" in message and "layout='whole'" in message, message


def _muon_on_all(model, kind):
    return [torch.optim.Muon(model.parameters(), lr=1e-2)]


def test_muon_is_refused_on_rows_and_refuses_flat_pieces_itself(monkeypatch):
    assert "layout='whole'" in run_ranks(_refused, 2, "rows", "muon")[0]
    # flat: every piece is 1-D, so `p.ndim == 2` finds no matrix ("an empty parameter list"),
    # and Muon given them all refuses them itself (torch's own check), before any step
    assert "empty parameter list" in run_ranks(_refused, 2, "flat", "muon")[0]
    monkeypatch.setitem(globals(), "_optimizers", _muon_on_all)
    assert "2D parameters" in run_ranks(_refused, 2, "flat", "muon")[0]


def test_lbfgs_is_refused_under_every_layout(monkeypatch):
    monkeypatch.setitem(globals(), "_optimizers", _lbfgs)
    for layout in ("flat", "whole"):
        assert "LBFGS cannot train a model sharded by zero" in run_ranks(
            _refused, 2, layout, "lbfgs")[0]


def _padding(rank, n, model):
    """Bytes per rank of the whole layout's shards over the flat layout's (fp32)."""
    base = MODELS[model]()
    out = {}
    for layout in ("flat", "whole"):
        m = copy.deepcopy(base)
        for unit in m.units():
            zero.shard(unit, stage=3, layout=layout)
        out[layout] = 4 * sum(u.layout.shard_numel for u in zero.units_of(m))
    return out


def test_whole_pads_more_than_flat_and_says_how_much():
    got = run_ranks(_padding, 2, "gpt")[0]
    assert got["whole"] >= got["flat"]


def _a_second_phase(rank, n, layout):
    """A second optimizer built after the first stepped every unit (a second fine-tuning
    phase, ``Trainer.train()`` again, Lightning's LR finder): it trains as DDP's does, and
    its state dict is refused like the first one's."""
    torch.manual_seed(0)
    base = MODELS["mlp"]()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=getattr(base, "has_unused_parameters",
                                                                  False))
    ours = copy.deepcopy(base)
    for unit in ours.units():
        zero.shard(unit, stage=2, layout=layout)
    said = []
    for phase in range(2):
        ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2 / (phase + 1))
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2 / (phase + 1))
        for s in range(2):
            x, y = base.batch(4, torch.Generator().manual_seed(10 * s + rank + 100 * phase))
            base.loss(ddp(x), y).backward()
            base.loss(ours(x), y).backward()
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
        try:
            opt.state_dict()
            said.append("given")
        except RuntimeError as e:
            said.append(str(e))
    full = zero.full_state_dict(ours)
    return said, all(torch.equal(full[k], p) for k, p in ddp.module.named_parameters())


@pytest.mark.parametrize("layout", sample(["whole"], ["whole", "flat"]))
def test_an_optimizer_built_after_the_first_stepped_gets_zeros_hooks(layout):
    for said, same in run_ranks(_a_second_phase, 2, layout):
        assert all("zero.save" in s for s in said), said
        assert same
