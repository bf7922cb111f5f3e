"""Disk offload under a memory limit: the optimizer state larger than the memory allowed.

    python benchmarks/disk_limit.py                 # 16 units of 1024 x 1024, 2 ranks, ~30 s
    python benchmarks/disk_limit.py --budget-mib 24 --layers 8

A stack of ``--layers`` Linear(dim, dim) units, ZeRO-3 on 2 gloo ranks, AdamW: its state is
8 bytes a parameter, 8.4 MB a unit a rank at dim 1024. Each rank first runs one forward and
backward (everything but the optimizer state exists then), then its address space may grow
by ``--budget-mib`` only (``RLIMIT_AS``) while it trains ``--steps`` steps. Three runs, on
ranks forked from a fresh interpreter (a forked child of a long-lived process inherits free
memory the limit does not see): in memory without the limit (the reference), in memory under
it, and with ``zero.DiskOffload`` under it. glibc is told to map every tensor above 64 KiB on its own and
unmap it when it is freed (``M_MMAP_THRESHOLD``, one arena), so the address space follows the
live tensors. Prints one table; ``--json`` one JSON object a run.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from argtypes import int_in  # noqa: E402

RUNS = ("memory", "memory, limited", "disk, limited")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


def rank_run(rank: int, n: int, directory: str | None, budget: int, layers: int, dim: int,
             steps: int) -> dict:
    import ctypes
    import resource

    import torch

    import zero

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: every tensor above 64 KiB mapped on its own
    libc.mallopt(-8, 1)  # M_ARENA_MAX: one arena (a thread's arena reserves 64 MiB at once)
    threading.stack_size(1 << 20)  # the threads started later (waits, disk I/O): 1 MiB stacks,
    # not 8 (glibc keeps exited threads' stacks: they would blur the limit by 8 MiB each)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    offload = zero.DiskOffload(os.path.join(directory, f"rank{rank}")) if directory else None
    for m in [*model, model]:
        zero.shard(m, stage=3, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    state = sum(8 * p.numel() for p in model.parameters())
    start = _vm_size()
    if budget:
        resource.setrlimit(resource.RLIMIT_AS, (start + budget, resource.RLIM_INFINITY))
    times, peak = [], start
    try:
        for _ in range(steps):
            t = time.perf_counter()
            opt.step()
            opt.zero_grad()
            model(x).square().mean().backward()
            times.append(time.perf_counter() - t)
            peak = max(peak, _vm_size())
    except RuntimeError as e:  # torch's "can't allocate memory", or a rank waiting for it
        return {"error": str(e).splitlines()[0][:160], "state": state}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
    digest = hashlib.sha256()
    for name, t in sorted(zero.full_state_dict(model).items()):
        digest.update(name.encode() + t.numpy().tobytes())
    store = zero.features.disk_offload.stores_of(opt)[0] if directory else None
    return {"state": state, "params_sha256": digest.hexdigest()[:16],
            "held": store.peak_bytes if store else state, "grown": peak - start,
            "step_s": statistics.median(times[1:] or times)}


def _runs(args) -> None:
    """The three runs, one after the other, each on ranks forked from this fresh interpreter
    (which itself allocates nothing they would inherit); one JSON line a run."""
    from zerolab.launch import run_ranks

    for run in RUNS:
        directory = tempfile.mkdtemp(prefix="zero-disk-limit-") if run.startswith("disk") else None
        budget = args.budget_mib << 20 if run.endswith("limited") else 0
        try:
            results = run_ranks(rank_run, 2, directory, budget, args.layers, args.dim, args.steps)
        except Exception as e:  # (run_ranks: a rank that raised outside the loop)
            results = [{"error": str(e).splitlines()[0][:160]}]
        print(json.dumps({"run": run, "budget": budget, "ranks": results}), flush=True)


def measure(layers: int, dim: int, budget_mib: int, steps: int) -> list[dict]:
    """The three runs, in a fresh interpreter: one dict a run."""
    env = {**os.environ, "ZERO_TIMEOUT": os.environ.get("ZERO_TIMEOUT", "20")}
    cmd = [sys.executable, os.path.abspath(__file__), "--ranks", "--layers", str(layers),
           "--dim", str(dim), "--budget-mib", str(budget_mib), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(RUNS):]]


def table(results: list[dict], budget_mib: int) -> list[str]:
    lines = ["| run | optimizer state a rank (MiB) | limit on growth (MiB) | outcome | "
             "state held at once (MiB) | address space grown, after the steps (MiB) | step (ms) |",
             "|---|---|---|---|---|---|---|"]
    ref = results[0]["ranks"][0]
    for r in results:
        rank0 = r["ranks"][0]
        if "error" in rank0:
            outcome, held, grown, step = f"raised: {rank0['error'][:70]}", "-", "-", "-"
        else:
            same = "bitwise as the reference" if rank0["params_sha256"] == ref.get(
                "params_sha256") else "DIFFERENT from the reference"
            outcome = f"trained; {same}" if r is not results[0] else "trained (reference)"
            held, grown = f"{rank0['held'] / 2**20:.1f}", f"{rank0['grown'] / 2**20:.1f}"
            step = f"{1e3 * rank0['step_s']:.0f}"
        limit = f"{budget_mib}" if r["budget"] else "none"
        state = rank0.get("state", 0) / 2**20
        lines.append(f"| {r['run']} | {state:.1f} | {limit} | {outcome} | {held} | {grown} | {step} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int_in(2, 256), default=16)
    p.add_argument("--dim", type=int_in(64, 8192), default=1024)
    p.add_argument("--budget-mib", type=int_in(1, 1 << 20), default=32)
    p.add_argument("--steps", type=int_in(2, 1000), default=5)
    p.add_argument("--json", action="store_true", help="one JSON object a run")
    p.add_argument("--ranks", action="store_true", help=argparse.SUPPRESS)  # (the runs, here)
    args = p.parse_args(argv)
    if args.ranks:
        return _runs(args)
    results = measure(args.layers, args.dim, args.budget_mib, args.steps)
    if args.json:
        print("\n".join(json.dumps(r) for r in results))
        return
    import platform

    import torch

    print(f"# Disk offload under a memory limit, {datetime.date.today()}\n\n"
          f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores; torch {torch.__version__}\n"
          f"- `python benchmarks/disk_limit.py --layers {args.layers} --dim {args.dim} "
          f"--budget-mib {args.budget_mib} --steps {args.steps}`: {args.layers} units of "
          f"Linear({args.dim}, {args.dim}), ZeRO-3, 2 gloo ranks, AdamW; the limit applies "
          f"after a first forward and backward; step: median of the steps after the first\n")
    print("\n".join(table(results, args.budget_mib)))


if __name__ == "__main__":
    main()
