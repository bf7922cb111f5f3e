"""Hybrid sharding on 4 CPU ranks seen as 2 nodes x 2 ranks: HSDP (a 2-D mesh: shard within a
node, replicate across nodes) against FSDP2's HSDP and DDP, and ZeRO++'s hpZ (stage 3 with a
secondary shard per node) against plain stage 3, with the ledger's bytes per group."""

import pytest
import torch

import zero
from compare import System, first_difference
from conftest import sample
from harness import run_ranks
from zerolab.models import GPT

MESH = (2, 2)  # (replicas = nodes, shards = ranks per node)


def _against(rank, n, ref_kind, kinds, ref_kw, kw, mp=False, steps=3):
    torch.manual_seed(0)
    base = GPT()
    ref = System(ref_kind, base, "adamw", mp=mp, **ref_kw)
    ours = [System(k, base, "adamw", mp=mp, **kw) for k in kinds]
    failures = []
    for s in range(steps):
        ref.step(rank, s)
        for sys_ in ours:
            sys_.step(rank, s)
            if (diff := first_difference(sys_.full_params(), ref.full_params())) is not None:
                failures.append(f"{sys_.kind} after step {s}: {diff}")
    return failures


@pytest.mark.parametrize("mp", sample([False], [False, True]))
@pytest.mark.full  # test_fully_shard.py checks HSDP against FSDP2 in the sample
def test_hsdp_is_bitwise_equal_to_fsdp2_hsdp(mp):
    mesh = {"mesh_shape": MESH}
    assert run_ranks(_against, 4, "fsdp2", ["zero3"], mesh, mesh, mp) == [[]] * 4
    assert run_ranks(_against, 4, "fsdp2-noreshard", ["zero2"], mesh, mesh, mp) == [[]] * 4


def test_hsdp_stages_1_and_2_against_ddp():
    # At (2, 2), (a + b) / 2 averaged with (c + d) / 2 is not DDP's sum of four quarters in
    # gloo's ring order: within 1e-6, not bitwise. At (2, 1), pure replication, each mean is
    # of two numbers, and halving is exact: bitwise (notes/14-hybrid.md has the arithmetic).
    worst = run_ranks(_max_rel, 4)[0]
    assert 0 < worst <= 1e-6, worst
    pure = {"mesh_shape": (2, 1)}
    assert run_ranks(_against, 2, "ddp", ["zero1", "zero2", "zero3"], {}, pure) == [[]] * 2


def _max_rel(rank, n):
    from compare import max_relative_difference

    torch.manual_seed(0)
    base = GPT()
    ddp = System("ddp", base, "sgd")
    ours = [System(k, base, "sgd", mesh_shape=MESH) for k in ("zero1", "zero2")]
    worst = 0.0
    for s in range(3):
        ddp.step(rank, s)
        for sys_ in ours:
            sys_.step(rank, s)
            worst = max(worst, max_relative_difference(sys_.full_params(), ddp.full_params()))
    return worst


def _traffic(rank, n, kw):
    torch.manual_seed(0)
    sys_ = System("zero3", GPT(), "adamw", **kw)
    sys_.step(rank, 0)
    with zero.Ledger() as ledger:
        sys_.step(rank, 1)
    units = zero.units_of(sys_.model)
    by = {}
    for r in ledger.records:
        if r.op != "agree":
            key = (r.op, r.phase, r.group)
            by[key] = by.get(key, 0) + r.sent_bytes
    return by, sum(u.layout.padded_numel for u in units), max(u.layout.padded_numel for u in units)


def test_hsdp_ledger_bytes_per_group():
    by, padded, _ = run_ranks(_traffic, 4, {"mesh_shape": MESH})[0]
    # Within a node: the stage-3 gathers and the reduce-scatter (shard group of 2: half of each
    # buffer). Across nodes: only the all-reduce of each rank's gradient shard: 2 (R-1)/R of
    # P/2 fp32 elements, where DDP would all-reduce all P across all four ranks.
    assert all(group == "intra-node" for (op, _, group) in by if op in ("all_gather", "reduce_scatter"))
    inter = sum(v for (op, _, group), v in by.items() if group == "inter-node")
    assert inter == 4 * (padded // 2) * 2 * (2 - 1) // 2, (inter, padded)


def test_hpz_equals_plain_stage3_and_gathers_within_the_node_in_backward():
    assert run_ranks(_against, 4, "zero3", ["zero3"], {}, {"ranks_per_node": 2}) == [[]] * 4
    by, _, _ = run_ranks(_traffic, 4, {"ranks_per_node": 2})[0]
    backward_gathers = {group for (op, phase, group) in by if op == "all_gather" and phase == "backward"}
    assert backward_gathers == {"intra-node"}, by
    assert by[("all_gather", "forward", "world")] > 0  # forward still gathers from all ranks


def _hpz_memory(rank, n, kw):
    from zerolab.trackers import MODEL_STATES, ZeroMemTracker

    torch.manual_seed(0)
    sys_ = System("zero3", GPT(), "adamw", **kw)
    sys_.step(rank, 0)
    held = []
    units = zero.units_of(sys_.model)
    sys_.model.register_forward_hook(  # after the whole forward: what waits for backward
        lambda m, a, o: held.append(sum(u.held().secondary.numel() for u in units
                                        if u.held().secondary is not None)))
    with ZeroMemTracker(sys_.model, sys_.opt) as mt:
        sys_.step(rank, 1)
    return held[-1], [u.layout.padded_numel for u in units if u.reshard_after_forward]


def test_hpz_holds_a_secondary_shard_of_each_resharded_unit_until_its_backward():
    held, padded = run_ranks(_hpz_memory, 4, {"ranks_per_node": 2})[0]
    assert held == sum(p // 2 for p in padded)  # P / ranks-per-node of every resharded unit


def test_cost_model_arithmetic():
    from zerolab.cost import Cluster, collective_time, crosses_nodes

    c = Cluster("test", ranks_per_node=8, intra_gbs=100, inter_gbs=10, intra_alpha_us=1,
                inter_alpha_us=2)
    # a ring all-reduce over 4 ranks of one node: 2 x 3 steps of 1 us, 1e9 bytes at 100 GB/s
    assert collective_time("all_reduce", 1e9, 4, False, c) == pytest.approx(6e-6 + 1e-2)
    # an all-gather over 16 ranks spans two nodes: 15 steps of 2 us, at 10 GB/s
    assert collective_time("all_gather", 1e9, 16, True, c) == pytest.approx(30e-6 + 1e-1)
    assert not crosses_nodes("world", 8, c) and crosses_nodes("world", 9, c)
    assert crosses_nodes("inter-node", 2, c) and not crosses_nodes("intra-node", 64, c)


def test_simulated_hsdp_sends_only_shards_across_nodes():
    # benchmarks/simulate.py on fake ranks: 16 ranks as 2 nodes of 8; across nodes only the
    # all-reduce of each rank's gradient shard, 2 (R-1)/R of P/8 (fp32: 4 bytes, R = 2)
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import simulate

    r = simulate.simulate(2e7, 16, 3, hybrid="hsdp", ranks_per_node=8)
    padded = sum(u[0] for u in r["units"])
    inter = sum(x.sent_bytes for x in r["records"] if x.group == "inter-node")
    assert inter == pytest.approx(4 * padded / 8, rel=1e-3)
    assert {x.group for x in r["records"] if x.op in ("all_gather", "reduce_scatter")} == {"intra-node"}


def test_hpz_with_qwz_computes_backward_with_forward_s_weights():
    """hpZ keeps a slice of the weights forward computed with (qwZ's dequantized ones); the
    gather within the node in backward moves them exactly, so backward computes with forward's
    weights and training equals qwZ alone, bit for bit (it re-quantized them, in other blocks)."""
    assert run_ranks(_against, 4, "zero3-qwz", ["zero3-qwz"], {},
                     {"ranks_per_node": 2}) == [[]] * 4
