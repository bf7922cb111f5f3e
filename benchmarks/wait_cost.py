"""What bounding every wait costs: our stages' step time with ZERO_TIMEOUT's bound and without.

    python benchmarks/wait_cost.py            # the comparison's GPT, 2 CPU ranks, ~2 min

One run, the systems interleaved (bounded, unbounded, bounded, ...) so that a drift of the
machine falls on both alike; each measurement is compare_stages.py's (median step time of the
timed steps, slowest rank). ``ZERO_TIMEOUT=0`` is the unbounded wait (``zero/comm/waits.py``).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_stages  # noqa: E402

KINDS, ROUNDS, STEPS = ("zero1", "zero2", "zero3"), 3, 40


def main() -> None:
    args = compare_stages.parse_args(["--steps", str(STEPS)])
    times: dict = {(k, b): [] for k in KINDS for b in ("bounded", "unbounded")}
    for _ in range(ROUNDS):
        for kind in KINDS:
            for bound in ("bounded", "unbounded"):
                os.environ["ZERO_TIMEOUT"] = "300" if bound == "bounded" else "0"
                times[kind, bound].append(compare_stages.run_system(kind, args)["step_time"])
    lines = [f"# Bounded waits: step time with and without ZERO_TIMEOUT's bound",
             "", f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores; torch "
             f"{torch.__version__}; {datetime.date.today()}",
             f"- `python benchmarks/wait_cost.py`: GPT of compare_stages.py, 2 gloo ranks, "
             f"{STEPS} timed steps, {ROUNDS} rounds interleaved", "",
             "| system | bounded (ms, each round) | unbounded (ms, each round) | median ratio |",
             "|---|---|---|---|"]
    for kind in KINDS:
        b, u = times[kind, "bounded"], times[kind, "unbounded"]
        ratio = statistics.median(x / y for x, y in zip(b, u))
        lines.append(f"| {kind} | {', '.join(f'{1e3 * x:.1f}' for x in b)} | "
                     f"{', '.join(f'{1e3 * x:.1f}' for x in u)} | {ratio:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"{datetime.date.today()}-{platform.machine()}-{os.cpu_count()}cpu-waits.md")
    open(out, "w").write(text)


if __name__ == "__main__":
    main()
