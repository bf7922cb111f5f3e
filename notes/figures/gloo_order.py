"""Does gloo's sum depend on where an element sits in the buffer? Put the same numbers at
every position of a reduce-scatter and see which sums come out where.

    python notes/figures/gloo_order.py > notes/figures/gloo_order.txt

Rank r contributes VALUES[r] at every position. The values are chosen so that different
summation orders round to different float32 results; a run of equal results is a stretch of
the buffer that gloo summed in one order. The shard sizes are those of one GPT block
(12704 parameters) at N = 3 and N = 4 (see flat_layout.py).
"""

import itertools

import torch

from zero import comm
from zerolab.launch import run_ranks

VALUES = [1.0, -1.0, 7e-8, 3e-8, 1e-8]
BLOCK = 12704


def reduce_same_everywhere(rank, n, shard):
    x = torch.full((n * shard,), VALUES[rank])
    out = torch.empty(shard)
    comm.reduce_scatter(out, x, op="sum")  # (N*S,) -> (S,), summed over ranks
    full = torch.empty(n * shard)
    comm.all_gather(full, out)  # to read every position on rank 0
    return full


def orders(n):
    """Every left-to-right order of adding the ranks' values, by the float32 result."""
    found, count = {}, {}
    perms = list(itertools.permutations(range(n)))
    for perm in perms:
        s = torch.tensor(VALUES[perm[0]])
        for r in perm[1:]:
            s = s + VALUES[r]
        found.setdefault(s.item(), "(" * (n - 2) + f"x{perm[0]}" + "".join(
            f" + x{r}" + (")" if i < n - 2 else "") for i, r in enumerate(perm[1:])))
        count[s.item()] = count.get(s.item(), 0) + 1
    return {v: f"{found[v]}  ({count[v]} of the {len(perms)} orders give this)" for v in found}


def main():
    for n in (2, 3, 4):
        shard = -(-BLOCK // n)
        full = run_ranks(reduce_same_everywhere, n, shard)[0]
        names = orders(n)
        runs = []
        for i, v in enumerate(full.tolist()):
            if runs and runs[-1][0] == v:
                runs[-1][2] = i + 1
            else:
                runs.append([v, i, i + 1])
        print(f"N = {n}: x_r = {VALUES[:n]}, buffer {n * shard} elements, shards of {shard} "
              f"(rank r owns [{shard}r, {shard}(r+1)))")
        print(f"  {len(set(full.tolist()))} distinct results; runs of equal results:")
        for v, lo, hi in runs:
            print(f"    [{lo:>5}, {hi:>5})  {v:.9g}  = e.g. {names.get(v, '?')}")
        print()


if __name__ == "__main__":
    main()
