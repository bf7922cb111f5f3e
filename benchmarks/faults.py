"""The fault matrix in the default mode: what a user who runs without ZERO_CHECK meets.

    python benchmarks/faults.py            # 2 CPU ranks, every case, about 3 minutes

The suite runs tests/comm/test_faults.py's misuse cases in check mode (every collective agreed on
first); users run the default mode, where only the forward's agreement and the bounded waits
stand between a divergence and a hang. This script runs every case of that file, both of its
tables, in the default mode (``ZERO_CHECK=0``, ``ZERO_TIMEOUT=4``), plus the cases whose
collectives differ in size (units of different sizes), and sorts each rank's ending:

- ``named``: the rank raised one of zero's errors, or an error naming the fix;
- ``silent``: every rank returned normally from a case that is misuse (nothing said, and the
  ranks' models may now differ);
- ``died``: a rank's process ended without raising (gloo aborts a process whose collective
  receives more bytes than it posted: SIGABRT, exit code -6);
- ``hang``: some rank still ran 30 s after the start.

The table goes to stdout; a committed copy is in benchmarks/results/.
"""

from __future__ import annotations

import collections
import datetime
import faulthandler
import os
import platform
import sys
import tempfile
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "comm"), os.path.join(HERE, "..", "tests")]
import test_faults  # noqa: E402  (the cases: tests/comm/test_faults.py)

import zero  # noqa: E402
from zerolab.launch import RankError, RankTimeout, run_ranks  # noqa: E402

BOUND, LIMIT = 4, 30  # ZERO_TIMEOUT, and the harness's hang limit, seconds


def _uneven(rank: int, skip: bool) -> None:
    """Stage 3 over units of three sizes; rank 1 skips (or repeats) the middle one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    for unit in (model[0], model[2], model[4]):
        zero.shard(unit, stage=3)
    zero.shard(model, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for s in range(2):
        h = model[1](model[0](x))
        if not (s == 1 and rank == 1 and skip):
            h = model[3](model[2](h))
            if s == 1 and rank == 1:
                h = model[3](model[2](h))  # twice
        model[4](h).sum().backward()
        opt.step()
        opt.zero_grad()


def _uneven_backward(rank: int, stage: int) -> None:
    """Stages 1/2 over units of different sizes; rank 1 skips one backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    for unit in (model[0], model[2]):
        zero.shard(unit, stage=stage)
    zero.shard(model, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        loss = model(torch.randn(4, 8)).sum()
        if not (s == 0 and rank == 1):
            loss.backward()
        opt.step()
        opt.zero_grad()


UNEVEN = {
    "stage 3: a rank skips a unit of another size": lambda r, t: _uneven(r, skip=True),
    "stage 3: a rank runs a unit of another size twice": lambda r, t: _uneven(r, skip=False),
    **{f"stage {s}: backward on one rank only, units of two sizes":
       (lambda r, t, s=s: _uneven_backward(r, s)) for s in (1, 2)},
}


def cases() -> dict:
    out = {name: fn for name, (fn, _) in test_faults.ERRORS.items()}
    out.update({name: (lambda r, t, fn=fn: fn(r)) for name, (fn, *_) in
                test_faults.DEFAULT_MODE.items() if name not in out})
    out.update(UNEVEN)
    return out


def _case(rank: int, n: int, name: str, tmp: str, stderr: str):
    _stderr_to(os.path.join(stderr, f"rank{rank}.txt"))
    os.environ["ZERO_CHECK"], os.environ["ZERO_TIMEOUT"] = "0", str(BOUND)
    start = time.monotonic()
    try:
        cases()[name](rank, tmp)
    except Exception as e:  # noqa: BLE001 - the matrix sorts whatever was raised
        return type(e).__name__, str(e).splitlines()[0][:90], time.monotonic() - start
    return None, "", time.monotonic() - start


def _stderr_to(path: str) -> None:
    """This rank's stderr (fd 2: gloo's own messages) and the fatal-error dump of a process
    killed by a signal (faulthandler, which pytest points at the terminal) into ``path``: a
    death the matrix expects is reported in the table, not as a crash on the screen."""
    out = open(path, "w")
    os.dup2(out.fileno(), 2)
    faulthandler.enable(file=out, all_threads=True)


def run_case(name: str, stderr: str | None = None) -> tuple[str, str]:
    """The case's ending and what it printed, in one line each; each rank's stderr goes to
    ``stderr/rank<r>.txt`` (by default a temporary directory, removed)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            results = run_ranks(_case, 2, name, os.path.join(tmp, "ckpt"), stderr or tmp,
                                timeout=LIMIT)
        except RankTimeout:
            return "hang", f"a rank still ran after {LIMIT} s"
        except RankError as e:
            text = str(e)
            died = [line for line in text.splitlines() if "died with exit code" in line]
            if died:
                return "died", f"{died[0]} after {time.monotonic() - start:.1f} s"
            return "named", text.splitlines()[-1][:120]
    if all(kind is None for kind, _, _ in results):
        return "silent", "every rank returned"
    said = "; ".join(f"rank {r}: {kind or 'returned'} after {s:.1f} s"
                     + (f" ({message})" if kind else "")
                     for r, (kind, message, s) in enumerate(results))
    return "named", said


def main() -> None:
    table = cases()
    counts: collections.Counter = collections.Counter()
    rows = []
    for name in table:
        ending, said = run_case(name)
        counts[ending] += 1
        rows.append(f"| {name} | {ending} | {said.replace('|', '/')} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"# The fault matrix in the default mode (ZERO_CHECK=0, ZERO_TIMEOUT={BOUND})\n")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores; torch "
          f"{torch.__version__}; {datetime.date.today()}")
    print(f"- `python benchmarks/faults.py`: {len(table)} cases on 2 gloo ranks "
          f"(tests/comm/test_faults.py's two tables, and {len(UNEVEN)} whose collectives differ in size)")
    print(f"- endings: " + ", ".join(f"{k} {counts[k]}" for k in ("named", "died", "silent", "hang")))
    print("\n| case | ending | what each rank said |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
