"""Bytes each rank sends in one step, by system, on the benchmark's GPT, in units of R.

    python notes/figures/traffic_by_system.py > notes/figures/traffic_by_system.txt

The model is benchmarks/compare_stages.py's default (4 blocks, dim 128, seq 64, vocab 512,
batch 8, AdamW) on 2 gloo ranks. Every system is counted from the outside by
zerolab.measure.CommBytes (torch's CommDebugMode + ring accounting), on the third step (DDP
rebuilds its buckets after the first). "in R" divides the elements sent by (N-1)/N · Ψ, the
paper's unit (section 7).
"""

import warnings

import torch

from zerolab.launch import run_ranks
from zerolab.measure import CommBytes
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

WORLD_SIZE = 2
CONFIG = GPTConfig(vocab=512, seq=64, dim=128, heads=4, layers=4)
BATCH = 8
KINDS = ["ddp", "ddp+zro", "zero1", "zero2", "zero3", "fsdp2"]
WHAT = {"ddp": "all-reduce the gradients",
        "ddp+zro": "DDP's all-reduce, then broadcast each rank's updated parameters",
        "zero1": "reduce-scatter the gradients, all-gather the parameters",
        "zero2": "the same, one unit at a time during backward",
        "zero3": "all-gather in forward and in backward, reduce-scatter",
        "fsdp2": "torch's fully_shard, the same units"}
warnings.filterwarnings("ignore")  # CommDebugMode's module hooks warn about backward hooks


def one_system(rank, n, kind):
    torch.manual_seed(0)
    system = System(kind, GPT(CONFIG), "adamw")
    for i in range(2):
        system.step(rank, i, batch=BATCH)
    with CommBytes(n) as cb:
        system.step(rank, 2, batch=BATCH)
    return dict(cb.elements), dict(cb.calls)


def main():
    psi = sum(p.numel() for p in GPT(CONFIG).parameters())
    ring = (WORLD_SIZE - 1) / WORLD_SIZE
    print(f"GPT {CONFIG}, batch {BATCH}: Ψ = {psi}; N = {WORLD_SIZE}; third step, rank 0\n")
    ops = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
    print(f"{'system':<8} {'in R':>6}  " + "".join(f"{op:>20}" for op in ops) + "   what")
    for kind in KINDS:
        elements, calls = run_ranks(one_system, WORLD_SIZE, kind)[0]
        cells = "".join(f"{elements[op] / (psi * ring):>14.3f} ({calls[op]:>2}x)" if op in calls
                        else f"{'-':>20}" for op in ops)
        total = sum(elements.values()) / (psi * ring)
        print(f"{kind:<8} {total:>6.3f}  {cells}   {WHAT[kind]}")
    model = GPT(CONFIG)
    root = sum(p.numel() for m in (model.tok_emb, model.pos_emb, model.ln_f) for p in m.parameters())
    print(f"\nthe root unit (embeddings, final norm; the head is tied): {root} parameters = "
          f"{root / psi:.3f} Ψ, so 3 - {root / psi:.3f} = {3 - root / psi:.3f}")


if __name__ == "__main__":
    main()
