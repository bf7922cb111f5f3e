"""Three facts about gloo's collectives that the code relies on, checked on 2 to 5 ranks.

    python notes/figures/collectives.py > notes/figures/collectives.txt

1. all-reduce gives the same bits as reduce-scatter followed by all-gather;
2. reduce-scatter with AVG gives the same bits as SUM followed by division by N;
3. an in-place all-gather (the input is this rank's slice of the output) works, and the
   output keeps its storage.
"""

import torch

from zero import comm
from zerolab.launch import run_ranks

SHARD = 10_000


def facts(rank, n):
    x = torch.randn(n * SHARD, generator=torch.Generator().manual_seed(rank))
    ar = x.clone()
    comm.all_reduce(ar, op="sum")  # (N*S,) -> (N*S,), summed over ranks
    shard_sum, shard_avg = torch.empty(SHARD), torch.empty(SHARD)
    comm.reduce_scatter(shard_sum, x.clone(), op="sum")  # (N*S,) -> (S,): slice r of the sum
    comm.reduce_scatter(shard_avg, x.clone(), op="avg")  # ... of the mean
    rs_ag = torch.empty(n * SHARD)
    comm.all_gather(rs_ag, shard_sum)  # (S,) -> (N*S,)

    full = torch.zeros(n * SHARD)
    full[rank * SHARD : (rank + 1) * SHARD] = rank + 1.0
    ptr = full.data_ptr()
    comm.all_gather(full, full[rank * SHARD : (rank + 1) * SHARD])  # in place
    expect = torch.arange(1.0, n + 1).repeat_interleave(SHARD)
    return {
        "all_reduce == all_gather(reduce_scatter)": torch.equal(ar, rs_ag),
        "AVG == SUM / N": torch.equal(shard_avg, shard_sum / n),
        "in-place all-gather correct, same storage":
            torch.equal(full, expect) and full.data_ptr() == ptr,
    }


def main():
    print(f"{SHARD} float32 per shard, random data per rank; True = bitwise equal on every rank\n")
    for n in (2, 3, 4, 5):
        per_rank = run_ranks(facts, n)
        merged = {k: all(r[k] for r in per_rank) for k in per_rank[0]}
        print(f"N = {n}: " + "; ".join(f"{k}: {v}" for k, v in merged.items()))


if __name__ == "__main__":
    main()
