"""What each shard layout costs: flat (FSDP1, DeepSpeed), rows (FSDP2), whole (ZeRO's optimizer
state partitioning as ZeroRedundancyOptimizer does it), side by side in one run.

    python benchmarks/layouts.py            # the comparison's GPT, 2 CPU ranks, stage 3, ~2 min

Per layout, our ZeRO-3 on compare_stages.py's GPT: model-state memory per rank (MemTracker),
the padding it adds over the flat layout, bytes sent per step (the ledger), the bytes it copies
between the gathered buffer and the one the parameters view (rows only: out after each
all-gather, in before each reduce-scatter), and the median step time. Then the padding of each
layout on a model with one large embedding, where whole parameters cost the most.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_stages  # noqa: E402
import report  # noqa: E402

import zero  # noqa: E402
from zerolab.launch import run_ranks  # noqa: E402
from zerolab.models import GPT, GPTConfig  # noqa: E402

LAYOUTS, STAGE, STEPS = ("flat", "rows", "whole"), 3, 40
BIG_EMBEDDING = GPTConfig(vocab=32000, dim=64, layers=2, seq=64)  # one 2.05M-element table


def shard_bytes(rank: int, n: int, config: GPTConfig, layout: str) -> dict:
    """This rank's fp32 shard bytes over all units, and the largest unit's full buffer."""
    model = GPT(config)
    for unit in model.units():
        zero.shard(unit, stage=STAGE, layout=layout)
    units = zero.units_of(model)
    return {"shard": 4 * sum(u.layout.shard_numel for u in units),
            "psi": sum(u.layout.numel for u in units)}


def main() -> None:
    args = compare_stages.parse_args(["--steps", str(STEPS)])
    rows = []
    for layout in LAYOUTS:
        args.layout = layout
        r = compare_stages.run_system(f"zero{STAGE}", args)
        r["layout"] = layout
        r["shard"] = run_ranks(shard_bytes, args.world_size, compare_stages_config(args),
                               layout)[0]["shard"]
        rows.append(r)
        print(f"{layout}: {1e3 * r['step_time']:.1f} ms", file=sys.stderr)
    n, flat = args.world_size, rows[0]
    big = {layout: run_ranks(shard_bytes, n, BIG_EMBEDDING, layout)[0] for layout in LAYOUTS}
    lines = [f"# The three layouts side by side, {datetime.date.today()}", "",
             f"- machine: {report.machine()} ({report.cpu_name()}); torch {torch.__version__}",
             f"- `python benchmarks/layouts.py`: ZeRO-{STAGE} on compare_stages.py's GPT "
             f"(Ψ = {flat['psi']:,}), {n} gloo ranks, AdamW fp32, {STEPS} timed steps", "",
             "| layout | model states (MiB, peak) | shard (KiB/rank) | padding over flat "
             "(KiB/rank) | sent (KiB/step) | copied in/out (KiB/step) | step (ms) | vs flat |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        copied = (r["buffers"].get("all_gather", 0) + r["buffers"].get("reduce_scatter", 0)
                  if r["layout"] == "rows" else 0)
        lines.append(
            f"| {r['layout']} | {r['model_states_peak'] / 2**20:.2f} | {r['shard'] / 1024:.1f} | "
            f"{(r['shard'] - flat['shard']) / 1024:.1f} | {r['ledger'] / 1024:.1f} | "
            f"{copied / 1024:.1f} | {1e3 * r['step_time']:.1f} | "
            f"{r['step_time'] / flat['step_time']:.2f} |")
    lines += ["", f"Padding on a GPT with one large embedding ({BIG_EMBEDDING.vocab} x "
              f"{BIG_EMBEDDING.dim}, tied to the head; Ψ = {big['flat']['psi']:,}), "
              f"{n} ranks, stage {STAGE}: the whole layout puts the table on one rank", "",
              "| layout | shard (KiB/rank) | padding over flat (KiB/rank) |", "|---|---|---|"]
    for layout in LAYOUTS:
        lines.append(f"| {layout} | {big[layout]['shard'] / 1024:.1f} | "
                     f"{(big[layout]['shard'] - big['flat']['shard']) / 1024:.1f} |")
    same = all(r["losses_all_ranks"] == flat["losses_all_ranks"] for r in rows)
    lines += ["", f"Losses of the three layouts {'agree bitwise' if same else 'DIFFER'} over "
              f"{sum(len(x) for x in flat['losses_all_ranks'])} (rank, step) values."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"{datetime.date.today()}-{report.machine()}-layouts.md")
    open(out, "w").write(text)


def compare_stages_config(args) -> GPTConfig:
    return GPTConfig(vocab=compare_stages.VOCAB, seq=args.seq, dim=args.dim, layers=args.layers,
                     heads=compare_stages.HEADS)


if __name__ == "__main__":
    main()
