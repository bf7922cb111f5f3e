"""How long gloo takes for each collective on the same 32 MB buffer, 2 CPU ranks.

Ring accounting says a reduce-scatter plus an all-gather moves the same bytes as one
all-reduce. gloo's implementations are not equally fast: this measures them.
Run: python notes/figures/gloo_collectives.py  (output: gloo_collectives.txt)
"""

import time

import torch
import torch.distributed as dist

from zerolab.launch import run_ranks

N_ELEMENTS = 8_000_000  # the full buffer: 32 MB of fp32
REPEATS = 5


def measure(rank: int, n: int) -> dict:
    full = torch.randn(N_ELEMENTS)
    shard = torch.empty(N_ELEMENTS // n)
    gathered = torch.empty(N_ELEMENTS)
    ops = {
        "all_reduce (N*S,)": lambda: dist.all_reduce(full),
        "reduce_scatter (N*S,) -> (S,)": lambda: dist.reduce_scatter_single(shard, full),
        "all_gather (S,) -> (N*S,)": lambda: dist.all_gather_single(gathered, shard),
    }
    out = {}
    for name, op in ops.items():
        op()  # warm
        dist.barrier()
        start = time.perf_counter()
        for _ in range(REPEATS):
            op()
        out[name] = (time.perf_counter() - start) / REPEATS * 1000
    return out


if __name__ == "__main__":
    for rep in range(3):
        times = run_ranks(measure, 2)[0]
        line = ", ".join(f"{k}: {v:.1f} ms" for k, v in times.items())
        ratio = (times["reduce_scatter (N*S,) -> (S,)"] + times["all_gather (S,) -> (N*S,)"]) \
            / times["all_reduce (N*S,)"]
        print(f"run {rep}: {line}; (reduce_scatter + all_gather) / all_reduce = {ratio:.2f}")
