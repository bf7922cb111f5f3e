"""The plan's step time: operators priced by a roofline (zerolab/roofline.py), collectives played
beside them as each system's schedule runs them (zerolab/overlap.py). Single process, small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from zerolab import overlap
from zerolab.clusters import PRESETS
from zerolab.overlap import Comm, Task
from zerolab.roofline import Device, Op, OpCosts, Roofline


def test_attention_flops_are_counted_causal_half_and_flash_backward():
    # (batch 2, heads 4, seq 64, head dim 32): 4 x 2 x 4 x 64 x 64 x 32 = 4,194,304 FLOPs
    # forward (QK^T and AV); causal: the masked half skipped; backward 2.5 times the forward
    with FakeTensorMode():
        q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
        with OpCosts() as oc:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    attention = [op for op in oc.ops if op.kind == "attention"]
    assert [op.flops for op in attention] == [4_194_304 / 2, 2.5 * 4_194_304 / 2]
    assert [op.dense_flops for op in attention] == [4_194_304, 0]  # model FLOPs: whole, forward


def test_matmuls_by_torchs_formula_views_free_embeddings_read_rows():
    with FakeTensorMode():
        a, b = torch.randn(64, 32), torch.randn(32, 16)
        table, idx = torch.randn(1000, 8), torch.randint(0, 1000, (5,))
        with OpCosts() as oc:
            a @ b
            a.view(32, 64).t()
            F.embedding(idx, table)
    mm, emb = oc.ops  # (the views cost nothing)
    assert mm.kind == "matmul" and mm.flops == 2 * 64 * 32 * 16
    assert mm.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)  # both inputs read, the output written
    assert emb.kind == "memory" and emb.bytes == 2 * 4 * 5 * 8 + 8 * 5  # rows read and written


def test_the_roofline_takes_the_slower_of_compute_and_memory():
    gpu = Device("test", tflops_bf16=100, tflops_fp32=50, memory_tbs=1, matmul_efficiency=0.5,
                 attention_efficiency=0.25)
    roof = Roofline(gpu)
    square = Op("matmul", 1e12, 10**9, True)  # 1 TFLOP at 50 TFLOPS: 20 ms; 1 GB at 1 TB/s: 1 ms
    thin = Op("matmul", 1e9, 10**10, True)  # memory-bound: 10 ms
    assert roof.seconds(square) == pytest.approx(0.02)
    assert roof.seconds(thin) == pytest.approx(0.01)
    assert roof.seconds(Op("matmul", 1e12, 0, False)) == pytest.approx(0.04)  # fp32: TF32 peak
    assert roof.seconds(Op("attention", 1e12, 0, True)) == pytest.approx(0.04)
    assert roof.seconds(Op("memory", 0, 10**9, True)) == pytest.approx(0.001)
    assert Roofline(gpu, scale=0.5).seconds(square) == pytest.approx(0.04)  # --efficiency


PIECES = [1, 2, 2, 1, 1, 4, 4, 1, 1]  # forward root, b0, b1, root; backward root, b1, b0, root; step
UNITS = {"root": Comm(gather_forward=1, reduce=1), 0: Comm(3, 3, 2), 1: Comm(3, 3, 2)}


def test_fsdp2_hides_each_reduce_scatter_under_the_next_units_backward():
    # Worked by hand: gathers of b0 and b1 under the root's and b0's forward (b1 waits 1 s);
    # b1's backward gather under the head's backward (waits 2 s); b1's reduce-scatter runs under
    # b0's backward and b0's under the root's, waited for at the end: 8 s exposed in all
    out = overlap.run(PIECES, overlap.tasks_for("fsdp2", 2, UNITS, True))
    assert out == {"step_s": 25, "compute_s": 17, "contention_s": 0, "exposed_comm_s": 8}


def test_ours_runs_fsdp2s_schedule_and_a_deeper_queue_hides_more():
    # zero's stages 2 and 3 wait for a reduce-scatter in the next unit's post-backward, and
    # the root's backward prefetches the last block, as FSDP2 does: the same step
    fsdp2 = overlap.run(PIECES, overlap.tasks_for("fsdp2", 2, UNITS, True))
    assert overlap.run(PIECES, overlap.tasks_for("zero3", 2, UNITS, True)) == fsdp2
    assert overlap.tasks_for("zero2", 2, UNITS, True)[-3:] == \
        overlap.tasks_for("fsdp2-noreshard", 2, UNITS, True)[-3:]  # (its reductions)
    # Deeper: 3 blocks, each reduce-scatter 3 s, each block's backward 2 s. One in flight:
    # b2's (8-11 s) holds b0's backward to 11, b1's (11-14) holds the root's to 14: 2 s
    # exposed. Two in flight: each is waited one unit later, under the root's 10 s: none.
    pieces, units = [1] * 6 + [2, 2, 2, 10, 1], {j: Comm(reduce=3) for j in range(3)}
    one = overlap.run(pieces, overlap.tasks_for("zero3", 3, units, True))
    two = overlap.run(pieces, overlap.tasks_for("zero3", 3, units, True, depth=2))
    assert (one["exposed_comm_s"], two["exposed_comm_s"]) == (2, 0)


def test_compute_beside_a_collective_runs_slower():
    # 4 s of compute; a 2 s collective issued as it starts: while it runs the compute does
    # 2 / 1.5 = 4/3 s of its work, the other 8/3 s alone after it: 14/3 s, 2/3 s contention
    out = overlap.run([4, 0], [Task(2, ("start", 0), 1)], slowdown=0.5)
    assert out["step_s"] == pytest.approx(14 / 3) and out["compute_s"] == 4
    assert out["contention_s"] == pytest.approx(2 / 3) and out["exposed_comm_s"] == pytest.approx(0)
    # nothing beside it: no slower
    assert overlap.run([4, 0], [Task(2, ("end", 0), 1)], slowdown=0.5)["step_s"] == 6


def test_nothing_to_hide_behind_is_all_exposed():
    tasks = [Task(5, ("end", 0))]  # issued after the last compute before the step
    assert overlap.run([1, 0, 2], tasks)["step_s"] == 8
    assert overlap.run([1, 3, 2], [Task(2, ("end", 0))])["exposed_comm_s"] == 0


def test_every_preset_names_its_source_and_a_measured_efficiency():
    for name, p in PRESETS.items():
        assert p.source and p.memory_bytes > 0, name
        d = p.device
        assert 0 < d.matmul_efficiency < 1 and 0 < d.attention_efficiency < 1
        assert 0 < d.memory_efficiency < 1 and 0 < d.comm_slowdown < 1 and d.launch_us > 0
        assert 0 < d.clock_factor <= 1 and p.cluster.nics_per_node > 0, name
    # only torchtitan's 500 W GPUs run below their rated clocks
    assert [n for n, p in PRESETS.items() if p.device.clock_factor < 1] == ["h100-96gb"]
    assert {"dgx-h100", "h100-96gb", "dgx-h200", "dgx-a100-40gb", "dgx-a100-80gb", "dgx-b200",
            "mi300x"} <= set(PRESETS)
