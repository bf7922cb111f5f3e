"""Misuse gets a clear error that names the fix, on every rank, and never a hang."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from harness import run_ranks
from zerolab.models import GPT, UnevenMLP


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e)
    return None


def _stage_out_of_range():
    zero.shard(nn.Linear(2, 2), stage=4)


def _optimizer_before_sharding():
    model = UnevenMLP()
    opt = torch.optim.AdamW(model.parameters())
    for unit in model.units():
        zero.shard(unit, stage=2)
    x, y = model.batch(2, torch.Generator())
    model.loss(model(x), y).backward()
    opt.step()


def _shard_twice():
    m = nn.Linear(2, 2)
    zero.shard(m, stage=3)
    zero.shard(m, stage=3)


def _tied_across_units():
    model = GPT()
    zero.shard(model.tok_emb, stage=3)  # head.weight is the same tensor, outside this unit
    zero.shard(model, stage=3)


def _mixed_dtypes():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.float64))
    zero.shard(m, stage=1)


def _mixed_stages():
    model = UnevenMLP()
    zero.shard(model.hidden, stage=2)
    zero.shard(model, stage=3)


def _child_after_parent():
    model = UnevenMLP()
    zero.shard(model, stage=3)
    zero.shard(model.hidden, stage=3)


def _reshard_option_on_stage1():
    zero.shard(nn.Linear(2, 2), stage=1, reshard_after_forward=True)


def _helpers_on_unsharded_model():
    zero.clip_grad_norm_(nn.Linear(2, 2), 1.0)


CASES = {
    "stage": (_stage_out_of_range, "ValueError", "stage must be 1, 2 or 3"),
    "optimizer": (_optimizer_before_sharding, "RuntimeError", "Build it after zero.shard"),
    "twice": (_shard_twice, "RuntimeError", "already sharded"),
    "tied": (_tied_across_units, "ValueError", "shard a common parent"),
    "dtypes": (_mixed_dtypes, "ValueError", "one unit needs one dtype"),
    "stages": (_mixed_stages, "ValueError", "use one stage for all units"),
    "order": (_child_after_parent, "RuntimeError", "Shard bottom-up"),
    "reshard": (_reshard_option_on_stage1, "ValueError", "only applies to stage 3"),
    "helpers": (_helpers_on_unsharded_model, "ValueError", "call zero.shard on it first"),
}


def _run_case(rank, n, name):
    return _error_of(CASES[name][0])


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_raises_an_error_naming_the_fix(name):
    _, kind, phrase = CASES[name]
    for error in run_ranks(_run_case, 2, name, timeout=30):
        assert error is not None, f"{name}: nothing raised"
        assert error[0] == kind and phrase in error[1], error[1]


def _different_models(rank, n, what):
    if what == "shapes":
        model = nn.Sequential(nn.Linear(4, 8 if rank == 0 else 6), nn.Linear(8 if rank == 0 else 6, 2))
    elif what == "structure":
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 + rank)])
    else:  # requires_grad differs
        model = nn.Sequential(nn.Linear(4, 4))
        model[0].weight.requires_grad_(rank == 0)
    error = _error_of(lambda: zero.shard(model, stage=3))
    dist.barrier()  # every rank got here: nobody hangs in a collective
    return error


@pytest.mark.parametrize("what", ["shapes", "structure", "requires_grad"])
def test_ranks_with_different_models_fail_at_shard_time_on_every_rank(what):
    for error in run_ranks(_different_models, 2, what, timeout=30):
        assert error is not None and error[0] == "ValueError", error
        assert "shard different modules" in error[1] and "rank 1 is about to shard" in error[1], error
