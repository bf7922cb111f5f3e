"""Exposed communication read from a real profiler trace: the emulation's figures, measured.

``zerolab/emulate.py`` plays a step's collectives on a preset's links and says how long the
computing stream waited for each kind. On a GPU the same figures come from torch's profiler:
every kernel is an interval on its stream, NCCL's kernels name their collective
(``ncclDevKernel_AllGather_RING_LL...``), and a communication kernel is *exposed* for as long
as no compute kernel runs beside it. So, per kind,

    exposed = | union(kind's kernels) minus union(compute kernels) |
    overlap = 1 - exposed / | union(every communication kernel) |

which is Holistic Trace Analysis's "communication/computation overlap" (HTA, on the package
index, reads the same traces), computed here from the intervals alone so that it runs, and is
tested, without a GPU. ``benchmarks/device_check.py`` profiles a step of each system under
``torchrun`` and prints these rows beside the emulated ones.
"""

from __future__ import annotations

import json
from typing import Iterable, NamedTuple

# NCCL's kernel names carry the collective: ncclDevKernel_AllGather_RING_LL(...),
# ncclKernel_ReduceScatter_..., ncclDevKernel_SendRecv (all-to-all).
KINDS = {"allgather": "all_gather", "reducescatter": "reduce_scatter",
         "allreduce": "all_reduce", "broadcast": "broadcast", "sendrecv": "all_to_all"}


class Kernel(NamedTuple):
    name: str
    stream: int
    start: float  # microseconds
    end: float


def kind_of(name: str) -> str | None:
    """The collective a kernel runs (its NCCL name), or None for a compute kernel."""
    low = name.lower().replace("_", "")
    if "nccl" not in low:
        return None
    return next((kind for key, kind in KINDS.items() if key in low), "other")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(these: list[tuple[float, float]], those: list[tuple[float, float]]) -> float:
    """How long ``these`` (a union) run while none of ``those`` (a union) does."""
    total, j = 0.0, 0
    for a, b in these:
        t = a
        while j < len(those) and those[j][1] <= t:
            j += 1
        k = j
        while t < b:
            if k < len(those) and those[k][0] < b:
                c, d = those[k]
                total += max(0.0, min(c, b) - t)
                t = max(t, d)
                k += 1
            else:
                total += b - t
                t = b
    return total


def figures(kernels: list[Kernel]) -> dict:
    """Exposed microseconds per collective kind, the total, the communication time and the
    overlap fraction, for one profiled step (its kernels on every stream)."""
    compute = _union((k.start, k.end) for k in kernels if kind_of(k.name) is None)
    comm = [k for k in kernels if kind_of(k.name) is not None]
    exposed = {}
    for kind in sorted({kind_of(k.name) for k in comm}, key=str):
        mine = _union((k.start, k.end) for k in comm if kind_of(k.name) == kind)
        exposed[kind] = _minus(mine, compute)
    every = _union((k.start, k.end) for k in comm)
    total_comm = _length(every)
    exposed_total = _minus(every, compute)
    return {"exposed": exposed, "exposed_total": exposed_total, "comm": total_comm,
            "compute": _length(compute),
            "overlap": 1 - exposed_total / total_comm if total_comm else 1.0}


def kernels_of(chrome_trace_path: str) -> list[Kernel]:
    """The device kernels of a trace torch's profiler exported (``export_chrome_trace``)."""
    events = json.load(open(chrome_trace_path))["traceEvents"]
    return [Kernel(e["name"], e["args"]["stream"], e["ts"], e["ts"] + e["dur"])
            for e in events if e.get("cat") == "kernel" and "stream" in e.get("args", {})]
