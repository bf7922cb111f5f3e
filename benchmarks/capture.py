"""Everything a training step does, as text: for checking that a refactor changed nothing.

A change to the mechanism's shape (not to what it computes) must leave every collective,
byte and bit as it was. This script prints, for a matrix of configurations (the three stages
in fp32 and bf16, the three layouts, CPU and disk offload, qwZ, qgZ, HSDP, hpZ, no_sync,
clipping, reshard_after_forward=False), on every rank and after every step: the loss as hex,
each ledger record (op, dtype, bytes, unit, phase, group; no times), and a hash of every
parameter's bytes; then the narrated traces of ``python -m zerolab trace --stage 1/2/3``
without their time column. Run it before and after, and compare the two files byte for byte::

    python benchmarks/capture.py > before.txt
    ... change the code ...
    python benchmarks/capture.py > after.txt && cmp before.txt after.txt
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import torch

import zero
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

STEPS = 3
# (name, world size, System keyword arguments, step keyword arguments)
CONFIGS = [
    *[(f"zero{s}-fp32", 2, dict(kind=f"zero{s}"), {}) for s in (1, 2, 3)],
    *[(f"zero{s}-bf16", 2, dict(kind=f"zero{s}", mp=True), {}) for s in (1, 2, 3)],
    *[(f"zero{s}-{layout}", 2, dict(kind=f"zero{s}", layout=layout), {})
      for s in (1, 3) for layout in ("rows", "whole")],
    ("zero3-rows-ws3", 3, dict(kind="zero3", layout="rows"), {}),
    ("zero3-flat-ws3-sgd", 3, dict(kind="zero3", opt="sgd"), {}),
    ("zero3-noreshard", 2, dict(kind="zero3", reshard_after_forward=False), {}),
    ("zero2-no_sync", 2, dict(kind="zero2"), dict(micro=2)),
    ("zero3-bf16-no_sync", 2, dict(kind="zero3", mp=True), dict(micro=2)),
    ("zero3-clip", 2, dict(kind="zero3"), dict(clip=(0.5, 2.0))),
    ("zero3-offload", 2, dict(kind="zero3-offload"), {}),
    ("zero3-offload-bf16", 2, dict(kind="zero3-offload", mp=True), {}),
    ("zero3-disk", 2, dict(kind="zero3-disk"), {}),
    ("zero3-disk-sgd", 2, dict(kind="zero3-disk", opt="sgd"), {}),
    ("zero3-qwz", 2, dict(kind="zero3-qwz"), {}),
    ("zero3-qgz", 4, dict(kind="zero3-qgz"), {}),
    ("zero3-hsdp", 4, dict(kind="zero3", mesh_shape=(2, 2)), {}),
    ("zero2-hsdp", 4, dict(kind="zero2", mesh_shape=(2, 2)), {}),
    ("zero3-hpz", 4, dict(kind="zero3", ranks_per_node=2), {}),
]


def _hex(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def _record(r) -> str:
    return (f"{r.op} {r.dtype} {r.buffer_bytes} {r.sent_bytes} {r.unit} {r.phase} {r.group} "
            f"{r.ranks}")


def _run(rank: int, world_size: int, kw: dict, step_kw: dict) -> list[str]:
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=64, seq=8, dim=32, layers=2))
    sys_ = System(base=base, **kw)
    lines = []
    for s in range(STEPS):
        with zero.Ledger() as ledger:
            losses, norm = sys_.step(rank, s, **step_kw)
        lines.append(f"rank {rank} step {s} loss {[v.hex() for v in losses.tolist()]}"
                     + (f" norm {float(norm).hex()}" if norm is not None else ""))
        lines += [f"  {_record(r)}" for r in ledger.records]
    lines += [f"  {n} {_hex(t)}" for n, t in sorted(sys_.full_params().items())]
    return lines


def main() -> None:
    only = sys.argv[1:]
    for name, ws, kw, step_kw in CONFIGS:
        if only and name not in only:
            continue
        print(f"== {name} (world size {ws})", flush=True)
        for lines in run_ranks(_run, ws, kw, step_kw, timeout=300):
            print("\n".join(lines))
    if only:
        return
    for stage in (1, 2, 3):
        out = subprocess.run([sys.executable, "-m", "zerolab", "trace", "--stage", str(stage)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": "0"}).stdout
        print(f"== trace --stage {stage}")
        for line in out.splitlines():  # the time column goes: it differs run to run
            print(re.sub(r"^ *\d+\.\d\d ", "", line))


if __name__ == "__main__":
    main()
