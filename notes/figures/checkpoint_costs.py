"""What a checkpoint costs: where the two layouts cut one unit, and the bytes moved per rank.

    python notes/figures/checkpoint_costs.py > notes/figures/checkpoint_costs.txt

1. GPT's root unit at world size 3: our flat shards against FSDP2's dim-0 chunks.
2. GPT (dim 64, 4 blocks), stage 3, AdamW after one step: per rank, the bytes sent by
   ``zero.save`` and by ``zero.load`` of a checkpoint saved at world size 2 (our ledger), the
   bytes written, the transient and held memory of the conversion, and the peak of what
   ``zero.load`` allocates into a fresh model and optimizer (torch's MemTracker) against this
   rank's shards plus one unit.
"""

import os
import tempfile
import time

import torch

import zero
from zero.core.flat import FlatLayout
from zero.checkpoint.fsdp2_layout import chunk_of
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

CFG = GPTConfig(dim=64, layers=4)


def layout_table(n=3):
    model = GPT()
    names = ["tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"]  # the root's own
    shapes = [dict(model.named_parameters())[k].shape for k in names]
    flat = FlatLayout(shapes, n)
    print(f"GPT's root unit at N = {n}: {flat.numel} elements, shard S = {flat.shard_numel}")
    print(f"{'parameter':16} {'shape':10} " + " ".join(f"{'rank ' + str(r):>22}" for r in range(n)))
    for i, (name, shape) in enumerate(zip(names, shapes)):
        ours, theirs = [], []
        for r in range(n):
            piece = next((p for p in flat.pieces(r) if p.param_index == i), None)
            ours.append(f"[{piece.param_offset}, {piece.param_offset + piece.length})" if piece else "-")
            ch = chunk_of(shape, n, r)
            theirs.append(f"[{ch.start}, {ch.stop})" if ch.stop > ch.start else "-")
        print(f"{name:16} {str(tuple(shape)):10} " + " ".join(f"{'ours ' + o:>22}" for o in ours))
        print(f"{'':27} " + " ".join(f"{'FSDP2 ' + t:>22}" for t in theirs))
    print("(elements of the flattened parameter each rank holds)\n")


def costs(rank, n, root):
    torch.manual_seed(0)
    s = System("zero3", GPT(CFG), "adamw")
    s.step(rank, 0)
    with zero.Ledger() as saving:
        start = time.perf_counter()
        written = zero.save(os.path.join(root, f"ws{n}"), s.model, s.opt)
        save_s = time.perf_counter() - start
    with zero.Ledger() as loading:
        start = time.perf_counter()
        zero.load(os.path.join(root, "ws2"), s.model, s.opt)
        load_s = time.perf_counter() - start
    mine = [f for f in os.listdir(written) if f.startswith(f"__{rank}_")]
    units = zero.units_of(s.model)
    return dict(save=saving.sent_bytes(), load=loading.sent_bytes(), save_s=save_s,
                load_s=load_s, wrote=sum(os.path.getsize(os.path.join(written, f)) for f in mine),
                largest_unit=4 * max(u.layout.padded_numel for u in units),
                held=3 * 4 * sum(u.layout.shard_numel for u in units),
                peak=_load_peak(root))


def _load_peak(root) -> int:
    """What zero.load allocates on this rank, at its peak, into a fresh model and optimizer
    (MemTracker; less what they held before)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(1)
    s, cpu = System("zero3", GPT(CFG), "adamw"), torch.device("cpu")
    tracker = MemTracker()
    tracker.track_external(s.model, s.opt)  # (an in-place copy into them is no allocation)
    with tracker:
        before = tracker.get_tracker_snapshot()[cpu]["Total"]
        zero.load(os.path.join(root, "ws2"), s.model, s.opt)
    return tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before


def main():
    layout_table()
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    print(f"GPT(dim 64, 4 blocks): psi = {psi:,} parameters, fp32, AdamW (2 states): "
          f"3 tensors a parameter, 12 psi = {12 * psi:,} bytes in all")
    print(f"{'N':>2} {'save sent':>10} {'12psi(N-1)/N':>12} {'load sent':>10} {'written':>9} "
          f"{'largest unit':>12} {'held 12psi/N':>12} {'load peak':>10} {'save s':>7} {'load s':>7}")
    with tempfile.TemporaryDirectory() as root:
        for n in (2, 3, 4):
            r = run_ranks(costs, n, root)[0]  # rank 0; every rank sends the same
            print(f"{n:>2} {r['save']:>10,} {12 * psi * (n - 1) // n:>12,} {r['load']:>10,} "
                  f"{r['wrote']:>9,} {r['largest_unit']:>12,} {r['held']:>12,} "
                  f"{r['peak']:>10,} {r['save_s']:>7.2f} {r['load_s']:>7.2f}")
    print("sent: bytes rank 0 sent (ring accounting, our ledger); load reads the N = 2 "
          "checkpoint;\nwritten: rank 0's data file (DCP adds a small header per tensor); "
          "largest unit: the transient\nall-gather buffer; held: the chunks zero.save hands to "
          "DCP; load peak: what zero.load allocates\non rank 0 at its peak, into a fresh model "
          "(MemTracker), against held + largest unit. 2 CPU cores,\ngloo, torch "
          + torch.__version__)


if __name__ == "__main__":
    main()
