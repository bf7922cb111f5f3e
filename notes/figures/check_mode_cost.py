"""What check mode (ZERO_CHECK=1) costs per training step: one more small all-gather before
every collective. The benchmark's default GPT on 2 CPU ranks (gloo), stages 1 to 3; median of
20 steps after 3 warm-up steps, the two modes interleaved in blocks of 5 steps so that both see
the same machine. Prints a table; the output is notes/figures/check_mode_cost.txt.
"""

import os
import statistics
import time

import torch

import zero
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig

STEPS, BLOCK, WARMUP = 20, 5, 3


def _measure(rank, n, stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, dim=128, seq=64))
    for unit in model.units():
        zero.shard(unit, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = {"0": [], "1": []}
    agreements = {}

    def step(s):
        x, y = model.batch(8, torch.Generator().manual_seed(s * 10 + rank))
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for s in range(WARMUP):
        step(s)
    for block in range(2 * STEPS // BLOCK):
        mode = "01"[block % 2]
        os.environ["ZERO_CHECK"] = mode
        for s in range(BLOCK):
            with zero.Ledger() as ledger:
                start = time.perf_counter()
                step(s)
                times[mode].append(time.perf_counter() - start)
            agreements[mode] = ledger.count("agree")
    return {m: (statistics.median(t), agreements[m]) for m, t in times.items()}


def main():
    print("| stage | default: ms/step (agreements) | check mode: ms/step (agreements) | cost |")
    print("|---|---|---|---|")
    for stage in (1, 2, 3):
        r = run_ranks(_measure, 2, stage)[0]
        (t0, a0), (t1, a1) = r["0"], r["1"]
        print(f"| {stage} | {1e3 * t0:.1f} ({a0}) | {1e3 * t1:.1f} ({a1}) | {100 * (t1 / t0 - 1):+.1f}% |")


if __name__ == "__main__":
    main()
