"""Scale: meta-device initialisation, and the simulation of big models on fake tensors
(benchmarks/simulate.py) against the ZeRO paper's formulas plus our documented extras."""

import json
import os
import sys

import pytest
import torch

import zero
from harness import run_ranks
from zerolab.memory import model_state_bytes
from zerolab.trackers import PeakMemTracker
from zerolab.models import GPT, GPTConfig, UnevenMLP, gpt_init

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import simulate  # noqa: E402


def _full_then_shard(make, init_fn, seed, stage):
    torch.manual_seed(0)
    model = make()
    if init_fn is not None:  # what a full initialisation does: every module, in order
        torch.manual_seed(seed)
        for mod in model.modules():
            init_fn(mod)
    for unit in model.units():
        zero.shard(unit, stage=stage)
    return model


def _meta_then_init(make, init_fn, seed, stage):
    with torch.device("meta"):
        model = make()
    for unit in model.units():
        zero.shard(unit, stage=stage)
    torch.manual_seed(seed)
    if init_fn is None:
        zero.init_parameters(model)
    else:
        zero.init_parameters(model, init_fn)
    return model


def _meta_equals_full(rank, n, stage):
    cases = [(GPT, gpt_init, 7), (UnevenMLP, None, 0)]  # None: reset_parameters, as built
    out = []
    for make, init_fn, seed in cases:
        a = zero.full_state_dict(_full_then_shard(make, init_fn, seed, stage))
        model = _meta_then_init(make, init_fn, seed, stage)
        b = zero.full_state_dict(model)
        out.append(list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a))
        opt = torch.optim.AdamW(model.parameters())  # and it trains
        x, y = model.batch(2, torch.Generator().manual_seed(rank))
        model.loss(model(x), y).backward()
        opt.step()
        out.append(all(torch.isfinite(v).all() for v in zero.full_state_dict(model).values()))
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_meta_init_equals_full_init_then_shard_bitwise(stage, n):
    assert all(all(r) for r in run_ranks(_meta_equals_full, n, stage))


def _init_memory(rank, n):
    cfg = GPTConfig(layers=8, dim=64, vocab=64, seq=16)
    with torch.device("meta"):
        model = GPT(cfg)
    for unit in model.units():
        zero.shard(unit, stage=3)
    units = zero.units_of(model)
    mt = PeakMemTracker()
    mt.track_external(*[u.sharded for u in units])  # the shards exist from zero.shard on
    shards = mt.get_tracker_snapshot()[torch.device("cpu")]["Total"]
    with mt:
        zero.init_parameters(model, gpt_init)
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    full = 4 * sum(u.layout.numel for u in units)
    root_and_block = 4 * (units[0].layout.padded_numel + units[1].layout.padded_numel)
    return peak - shards, root_and_block, full


def test_meta_init_never_materialises_the_full_model():
    extra, root_and_block, full = run_ranks(_init_memory, 2)[0]
    assert extra == root_and_block < full / 2, (extra, root_and_block, full)


def _forward_before_init(rank, n):
    with torch.device("meta"):
        model = UnevenMLP()
    for unit in model.units():
        zero.shard(unit, stage=3)
    try:
        model(torch.randn(2, 13))
    except RuntimeError as e:
        return str(e)


def test_forward_before_init_raises_naming_the_fix():
    assert "call zero.init_parameters" in run_ranks(_forward_before_init, 2)[0]


def _expected(units, stage, mp):
    """The paper's terms on our padded sizes, plus our documented extras (notes/09-scale.md)."""
    P = sum(u[0] for u in units)  # padded flat numel, all units
    S = sum(u[1] for u in units)  # this rank's shard numel, all units
    n = sum(u[2] for u in units)  # parameter tensors: AdamW keeps a 4-byte step for each
    optim = 8 * S + 4 * n
    if stage == 3:
        return 4 * S + 4 * S + optim
    params = 2 * P + 4 * S if mp else 4 * P  # compute copy (+ fp32 master shard when it is apart)
    if stage == 2:
        return params + 4 * S + optim  # fp32 gradient shards (the paper counts 2-byte ones)
    # stage 1: the full gradient, each rank's shard reduced in place into its own slot of it
    # (with a cast, every bf16 gradient lives until backward ends; then each upcast copy frees
    # its bf16 gradient before its shard exists)
    return params + (2 * P if mp else 4 * P) + optim


@pytest.mark.parametrize("mp", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_simulation_equals_the_formula_plus_documented_extras(stage, mp):
    r = simulate.simulate(3e6, 8, stage, mixed_precision=mp)
    units = r["units"]
    assert r["model_state_bytes_per_rank"] == _expected(units, stage, mp), r
    paper = model_state_bytes(r["params"], 8, stage, mp)
    assert r["paper_model_state_bytes"] == paper
    assert abs(r["model_state_bytes_per_rank"] - paper) / paper < 0.20  # small: padding is large
    assert r["transient_bytes_per_rank"] > 0 or (stage == 1 and not mp)


def test_simulate_cli_prints_json_per_stage(capsys):
    simulate.main(["--params", "3e6", "--world-size", "16", "--stage", "1,3", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [r["stage"] for r in rows] == [1, 3]
    for r in rows:
        assert r["world_size"] == 16 and r["params"] > 2e6
        assert r["model_state_bytes_per_rank"] > 0 and "transient_bytes_per_rank" in r
    assert rows[1]["model_state_bytes_per_rank"] < rows[0]["model_state_bytes_per_rank"]
