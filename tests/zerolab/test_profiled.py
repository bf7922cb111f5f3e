"""zerolab/profiled.py: exposed communication from a profiler trace's intervals, checked on
hand-made traces (the figures a GPU's trace gives, without a GPU)."""

import json

import pytest

from zerolab.profiled import Kernel, figures, kind_of, kernels_of


def test_kernels_are_told_apart_by_their_nccl_names():
    assert kind_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "all_gather"
    assert kind_of("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_float") == "reduce_scatter"
    assert kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"
    assert kind_of("ampere_sgemm_128x64_tn") is None


def test_exposed_is_what_no_compute_kernel_hides():
    # compute 0-10 and 20-30 on stream 7; an all-gather 5-15 (half hidden), a reduce-scatter
    # 12-18 (wholly exposed), an all-reduce 22-25 (hidden) on stream 20
    kernels = [Kernel("sgemm", 7, 0, 10), Kernel("sgemm", 7, 20, 30),
               Kernel("ncclDevKernel_AllGather_RING", 20, 5, 15),
               Kernel("ncclDevKernel_ReduceScatter_RING", 21, 12, 18),
               Kernel("ncclDevKernel_AllReduce_RING", 20, 22, 25)]
    got = figures(kernels)
    assert got["exposed"] == {"all_gather": 5, "all_reduce": 0, "reduce_scatter": 6}
    # the union of the collectives is 5-18 and 22-25: 16 us, of which 10-18 exposed
    assert got["comm"] == 16 and got["exposed_total"] == 8 and got["compute"] == 20
    assert got["overlap"] == pytest.approx(0.5)


def test_a_trace_file_gives_its_kernels(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "sgemm", "ts": 0, "dur": 4, "args": {"stream": 7}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
        {"cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 2, "dur": 4,
         "args": {"stream": 30}}]}))
    kernels = kernels_of(str(path))
    assert [k.stream for k in kernels] == [7, 30]
    assert figures(kernels)["exposed"] == {"all_gather": 2}
