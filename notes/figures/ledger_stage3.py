"""The ledger of one training step, and CommBytes counting the same step from outside.

    python notes/figures/ledger_stage3.py > notes/figures/ledger_stage3.txt

Part 1: every record of one stage-3 step (the second; the first is a warm-up) of the small
GPT on 2 gloo ranks, rank 0's view. Part 2: bytes sent per step and rank by each system,
counted by zerolab.measure.CommBytes (torch's CommDebugMode), and by our ledger for ours.
"""

import warnings

import torch

import zero
from zerolab.launch import run_ranks
from zerolab.measure import CommBytes
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

WORLD_SIZE = 2
CONFIG = GPTConfig()  # vocab 96, seq 16, dim 32, heads 4, layers 2
KINDS = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
STEPS = 3  # part 2 reports the last; the first steps set things up (DDP rebuilds its buckets)
warnings.filterwarnings("ignore")  # CommDebugMode's module hooks warn about backward hooks


def stage3_ledger(rank, n):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    psi = sum(p.numel() for p in model.parameters())
    for unit in model.units():
        zero.shard(unit, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        x, y = model.batch(4, torch.Generator().manual_seed(10 * i + rank))
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    with zero.Ledger() as ledger:
        step(1)
    padded = {u.name: u.layout.padded_numel for u in zero.units_of(model)}
    return psi, padded, ledger.records


def per_system(rank, n, kind):
    torch.manual_seed(0)
    system = System(kind, GPT(CONFIG), "adamw")
    per_step = []
    for i in range(STEPS):
        with CommBytes(n) as cb, zero.Ledger() as ledger:
            system.step(rank, i)
        per_step.append(cb.total())
    return (dict(cb.sent), dict(cb.calls), dict(cb.elements), ledger.sent_bytes(),
            dict(cb.unknown), per_step)


def main():
    psi, padded, records = run_ranks(stage3_ledger, WORLD_SIZE)[0]
    print(f"GPT {CONFIG}: Ψ = {psi} parameters; N = {WORLD_SIZE}; ring factor (N-1)/N = "
          f"{(WORLD_SIZE - 1) / WORLD_SIZE}")
    print("units (padded_numel): " + ", ".join(f"{k} {v}" for k, v in padded.items()))
    print(f"\nPart 1: zero.Ledger() records of one stage-3 step, rank 0\n")
    print(f"{'#':>2}  {'op':<15} {'unit':<9} {'phase':<9} {'dtype':<14} "
          f"{'buffer_bytes':>12} {'sent_bytes':>10}")
    for i, r in enumerate(records):
        print(f"{i:>2}  {r.op:<15} {r.unit:<9} {r.phase:<9} {str(r.dtype):<14} "
              f"{r.buffer_bytes:>12} {r.sent_bytes:>10}")
    total = sum(r.sent_bytes for r in records)
    big = sum(r.sent_bytes for r in records if r.op in ("all_gather", "reduce_scatter"))
    print(f"\nsent_bytes: {total} in all; {big} in all-gathers and reduce-scatters = "
          f"{big / (4 * psi * (WORLD_SIZE - 1) / WORLD_SIZE):.4f} R (R = 4 x Ψ x (N-1)/N bytes)")
    print("  by (op, phase): " + ", ".join(
        f"{op}/{ph} {sum(r.sent_bytes for r in records if (r.op, r.phase) == (op, ph))}"
        for op, ph in sorted({(r.op, r.phase) for r in records})))

    print(f"\nPart 2: bytes sent per step and rank, N = {WORLD_SIZE} (CommBytes = CommDebugMode "
          "+ ring accounting)\n")
    print(f"step {STEPS - 1} of steps 0..{STEPS - 1}; 'steps' = CommBytes of every step\n")
    print(f"{'system':<7} {'CommBytes':>9} {'ledger':>7} {'in R':>6}  calls; by op; steps")
    for kind in KINDS:
        sent, calls, elements, ledger, unknown, steps = run_ranks(per_system, WORLD_SIZE, kind)[0]
        ring = (WORLD_SIZE - 1) / WORLD_SIZE
        in_psi = sum(elements.values()) / (psi * ring)
        led = str(ledger) if kind.startswith("zero") else "-"
        print(f"{kind:<7} {sum(sent.values()):>9} {led:>7} {in_psi:>6.3f}  {calls}; {sent}; {steps}"
              + (f"; unaccounted {unknown}" if unknown else ""))


if __name__ == "__main__":
    main()
