"""The checks that need an accelerator, in one unattended run of a few minutes.

    python benchmarks/device_check.py            # on a machine with one GPU; prints one table

Everything else in the project runs on the CPU; this is the one script that needs a device,
and until it has run there, the CUDA path is untested. What it checks:

1. equality on the device at world size 1 (NCCL): our stages 1-3 against plain single-device
   training (fp32, bitwise), and against FSDP2 with bf16 compute and fp32 reduction (bitwise);
2. world size 2 on one device, gloo over device tensors, where gloo allows it: stage 3 against
   DDP (fp32, bitwise at world size 2), or the error gloo gives;
3. the stage comparison at a size that fills a few GiB (world size 1): peak device memory and
   median step time per stage;
4. CPU offload: ZeRO-3's peak device memory with the shards on the host, against without;
   and disk offload's (the optimizer state in files, the step on the host);
5. a model trained and deleted gives its device memory back to the byte, at each stage;
6. streams: the collectives' side streams (``zero/comm/context.py``'s note) run beside the
   computation: in a profiled ZeRO-3 step in bf16, how many of the kernels on the context's
   streams (the copy-ins' casts; with several GPUs under torchrun, NCCL's all-gathers and
   reduce-scatters) overlap a kernel of the computing stream. Check 1's equality runs with
   the streams on: the losses and parameters are bitwise the single-device run's;
7. time as the emulated cluster reports it, measured: with 2 or more GPUs, one profiled step of
   each system (DDP, ZeRO-1/2/3, FSDP2 with and without resharding; NCCL, bf16 compute) and,
   from the kernels of its trace (``zerolab/profiled.py``), the communication exposed per
   collective kind and the overlap fraction: the rows to read beside ``compare_stages.py
   --network``'s emulated ones; and how often a step makes the host wait for the device
   (torch's sync debug mode): the emulation takes zero's agreement and used flags to run on
   the host, beside the device, which this counts (0 expected, as for DDP and FSDP2).

Beside it, on the same GPU (about 2 minutes; notes/19, "Measuring your GPU's matmuls"), time
the plan's matmuls at their own shapes, the rate no source gives for the H100 rows it is fast on:

    python benchmarks/matmul_rates.py --model torchtitan:llama3:8B --batch 2 --seq 8192 \
        --mixed-precision --activation-checkpointing selective --cluster h100-96gb

Each line of the table says what ran, the result, and the seconds it took. ``--cpu-dry-run``
runs the same code on the CPU with gloo and the small model (tests/zerolab/test_device_check.py), so
that the script itself is tested where there is no device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

import zero
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

SMALL = GPTConfig()  # the test models' GPT: 2 blocks, dim 32
BIG = GPTConfig(vocab=32000, seq=512, dim=2048, layers=8, heads=16)  # ~0.45B params: a few GiB
STEPS = 3
DRY = {"on": False}  # --cpu-dry-run: the CPU, gloo, the small model, no device memory


def _device() -> torch.device:
    if DRY["on"]:
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _backend() -> str:
    return "gloo" if DRY["on"] else "nccl"


def _peak() -> int:
    return 0 if DRY["on"] else torch.cuda.max_memory_allocated()


def _sync() -> None:
    if not DRY["on"]:
        torch.cuda.synchronize()


def equality_ws1(rank: int, n: int) -> list[tuple[str, bool]]:
    device = _device()
    torch.manual_seed(0)
    base = GPT(SMALL).to(device)
    out = []
    for stage in (1, 2, 3):
        plain, ours = System("replicated", base, "adamw"), System(f"zero{stage}", base, "adamw")
        same = all(torch.equal(plain.step(rank, s)[0], ours.step(rank, s)[0])
                   for s in range(STEPS))
        want, got = plain.full_params(), ours.full_params()
        out.append((f"zero{stage} fp32 vs one device (streams on)",
                    same and all(torch.equal(want[k], got[k]) for k in want)))
    ref, ours = System("fsdp2", base, "adamw", mp=True), System("zero3", base, "adamw", mp=True)
    same = all(torch.equal(ref.step(rank, s)[0], ours.step(rank, s)[0]) for s in range(STEPS))
    out.append(("zero3 bf16/fp32 vs FSDP2", same))
    return out


def gloo_on_device(rank: int, n: int) -> tuple[str, bool | str]:
    device = _device()
    try:
        torch.manual_seed(0)
        base = GPT(SMALL).to(device)
        ddp, ours = System("ddp", base, "adamw"), System("zero3", base, "adamw")
        same = all(torch.equal(ddp.step(rank, s)[0], ours.step(rank, s)[0]) for s in range(STEPS))
        return ("zero3 fp32 vs DDP, 2 ranks, gloo on device tensors", same)
    except Exception as e:  # noqa: BLE001 - what gloo does not support is the finding
        return ("zero3, 2 ranks, gloo on device tensors", f"{type(e).__name__}: {str(e)[:120]}")


def memory_and_time(rank: int, n: int, kind: str) -> tuple[int, float]:
    device = _device()
    torch.manual_seed(0)
    with torch.device(device):
        base = GPT(SMALL if DRY["on"] else BIG)
    system = System(kind, base, "adamw", mp=True)
    del base
    _sync()
    if not DRY["on"]:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for s in range(STEPS + 1):
        t0 = time.perf_counter()
        system.step(rank, s, batch=2)
        _sync()
        times.append(time.perf_counter() - t0)
    return _peak(), statistics.median(times[1:])


def freed_after_delete(rank: int, n: int) -> list[tuple[str, bool | str]]:
    """A model trained, then deleted: its units are collected and the device memory it held
    comes back to the byte (tests/core/test_model_code.py checks the units on the CPU)."""
    import gc
    import weakref

    device, out = _device(), []
    for stage in (1, 2, 3):
        gc.collect()
        before = 0 if DRY["on"] else torch.cuda.memory_allocated()
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(SMALL)
        for unit in model.units():
            zero.shard(unit, stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for s in range(2):
            x, y = model.batch(2, torch.Generator().manual_seed(s))
            model.loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        units = [weakref.ref(u) for u in zero.units_of(model)]
        del model, opt, unit
        gc.collect()
        _sync()
        left = (0 if DRY["on"] else torch.cuda.memory_allocated()) - before
        alive = sum(u() is not None for u in units)
        out.append((f"zero{stage}: a trained model deleted: units alive, device bytes kept",
                    True if (alive, left) == (0, 0) else f"{alive} units, {left} B"))
    return out


def streams_overlap(rank: int, n: int) -> tuple[str, str | bool]:
    """A profiled ZeRO-3 step: side-stream kernels that overlap a computing-stream kernel."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    device = _device()
    torch.manual_seed(0)
    with torch.device(device):
        base = GPT(SMALL if DRY["on"] else BIG)
    system = System("zero3", base, "adamw", mp=True)
    system.step(rank, 0, batch=2)  # the schedule learns the order: the next step prefetches
    _sync()
    activities = [ProfilerActivity.CPU] + ([] if DRY["on"] else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        system.step(rank, 1, batch=2)
        _sync()
    if DRY["on"]:
        return ("streams: a profiled ZeRO-3 step (CPU: no device kernels)", True)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    kernels = [e for e in json.load(open(path))["traceEvents"]
               if e.get("cat") == "kernel" and "stream" in e.get("args", {})]
    streams: dict = {}
    for e in kernels:
        streams.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    compute = max(streams, key=lambda s: len(streams[s]))  # the computing stream: the busiest
    busy = sorted(streams[compute])
    side = [iv for s, ivs in streams.items() if s != compute for iv in ivs]
    overlap = sum(any(a < d and c < b for c, d in busy) for a, b in side)
    return (f"streams: side-stream kernels overlapping compute ({len(streams)} streams)",
            f"{overlap} of {len(side)}")


SYSTEMS = ("ddp", "zero1", "zero2", "zero3", "fsdp2-noreshard", "fsdp2")


def _host_syncs(step) -> str:
    """How often ``step`` made the host wait for the device (torch's sync debug mode: a
    ``.item()``, a device tensor read on the host...). zero's agreement and used flags go
    through a gloo group on the host (``CommContext.host``): 0 expected, as DDP and FSDP2."""
    import warnings

    if DRY["on"]:
        step()
        return "CPU: no device to wait for"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    said = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return f"{len(said)}" + (f" (first: {said[0][:80]})" if said else "")


def profiled_systems(rank: int, n: int) -> list[tuple[str, str]]:
    """One profiled step of each system on ``n`` ranks: exposed communication by kind and the
    overlap fraction, read from the trace's kernels (rank 0's)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from zerolab.profiled import figures, kernels_of

    device = torch.device("cpu") if DRY["on"] else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    activities = [ProfilerActivity.CPU] + ([] if DRY["on"] else [ProfilerActivity.CUDA])
    out = []
    for kind in SYSTEMS:
        torch.manual_seed(0)
        with torch.device(device):
            base = GPT(SMALL if DRY["on"] else BIG)
        system = System(kind, base, "adamw", mp=kind != "ddp")
        for s in range(2):  # warm-up: DDP's buckets, the schedules' order
            system.step(rank, s, batch=2)
        _sync()
        syncs = _host_syncs(lambda: system.step(rank, 3, batch=2))
        with profile(activities=activities) as prof:
            system.step(rank, 2, batch=2)
            _sync()
        out.append((f"host waits for the device in a step, {kind}, {n} ranks", syncs))
        what = f"profiled step, {kind}, {n} ranks: exposed us by kind; overlap"
        if DRY["on"]:
            out.append((what, "CPU: no device kernels"))
            continue
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        f = figures(kernels_of(path))
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in f["exposed"].items()) or "none"
        out.append((what, f"{kinds}; total {f['exposed_total']:.0f} of {f['comm']:.0f} us, "
                          f"overlap {f['overlap']:.0%}, compute {f['compute']:.0f} us"))
    return out


def main(argv: list[str] | None = None) -> list[tuple]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="the same checks on the CPU (gloo, the small model): tests the script")
    DRY["on"] = p.parse_args(argv).cpu_dry_run
    if not DRY["on"] and not torch.cuda.is_available():
        sys.exit("device_check.py needs a CUDA device; everything else runs on the CPU")
    rows = []

    def check(what, fn):
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception:  # noqa: BLE001 - report it and go on: the run is unattended
            got = [(what, "FAILED: " + traceback.format_exc(limit=2).splitlines()[-1])]
        for name, result in got:
            rows.append((name, result, time.perf_counter() - t0))

    check("equality at world size 1", lambda: run_ranks(equality_ws1, 1, backend=_backend(),
                                                        timeout=240)[0])
    check("gloo on device tensors", lambda: [run_ranks(gloo_on_device, 2, backend="gloo",
                                                       timeout=240)[0]])
    peaks = {}

    def stages():
        out = []
        for kind in ("zero1", "zero2", "zero3", "zero3-offload", "zero3-disk"):
            peak, step = run_ranks(memory_and_time, 1, kind, backend=_backend(), timeout=240)[0]
            peaks[kind] = peak
            out.append((f"{kind}, {'the small GPT' if DRY['on'] else '0.45B params'} "
                        "bf16/fp32, world size 1",
                        f"peak {peak / 2**30:.2f} GiB, step {1e3 * step:.0f} ms"))
        ratio = peaks["zero3-offload"] / peaks["zero3"] if peaks["zero3"] else float("nan")
        out.append(("CPU offload: ZeRO-3 peak device memory / without", f"{ratio:.3f}"))
        ratio = peaks["zero3-disk"] / peaks["zero3"] if peaks["zero3"] else float("nan")
        out.append(("disk offload: ZeRO-3 peak device memory / without", f"{ratio:.3f}"))
        return out

    check("the stage comparison", stages)
    check("a deleted model freed", lambda: run_ranks(freed_after_delete, 1,
                                                     backend=_backend(), timeout=240)[0])
    check("streams", lambda: [run_ranks(streams_overlap, 1, backend=_backend(),
                                        timeout=240)[0]])
    gpus = 2 if DRY["on"] else torch.cuda.device_count()
    if gpus >= 2:
        check("profiled systems", lambda: run_ranks(profiled_systems, min(gpus, 8),
                                                     backend=_backend(), timeout=480)[0])
    else:
        rows.append(("profiled systems", "needs 2 or more GPUs (NCCL sends nothing at world "
                     "size 1): rerun on a machine with several", 0.0))
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  result  (seconds)")
    for name, result, seconds in rows:
        print(f"{name:<{width}}  {result}  ({seconds:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
