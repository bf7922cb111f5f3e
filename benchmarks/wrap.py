"""What the choice of units costs: per block, two blocks a unit, FSDP1's size-based policy at
two thresholds, and the whole model as one unit (the mistake FSDP2's docs warn about), at
ZeRO-2 and ZeRO-3, in one run.

    python benchmarks/wrap.py            # the comparison's GPT, 2 CPU ranks, ~3 min

Per choice: the units and the largest one, model-state memory per rank at its peak
(MemTracker) beside our schedule's prediction (zerolab.memory.schedule), the collectives per
step and the bytes sent (the ledger), and the median step time. The root-only row at ZeRO-3
holds the whole model's parameters and gradients at once: the paper's per-rank formula
(16Ψ/N) plus 4Ψ of parameters and 4Ψ of gradients, less the gradient shards (4Ψ/N), which do
not exist yet while the full gradient does.
"""

from __future__ import annotations

import datetime
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_stages  # noqa: E402
import report  # noqa: E402

from zerolab.memory import model_state_bytes  # noqa: E402
from zerolab.systems import WRAPS  # noqa: E402

STAGES, STEPS = (2, 3), 40
MIB = 2**20


def main() -> None:
    args = compare_stages.parse_args(["--steps", str(STEPS)])
    rows = []
    for stage in STAGES:
        for wrap in WRAPS:
            args.wrap = wrap
            r = compare_stages.run_system(f"zero{stage}", args)
            r.update(stage=stage, wrap=wrap)
            rows.append(r)
            print(f"zero{stage} {wrap}: {1e3 * r['step_time']:.1f} ms", file=sys.stderr)
    n, psi = args.world_size, rows[0]["psi"]
    lines = [f"# Units: what their size costs, {datetime.date.today()}", "",
             f"- machine: {report.machine()} ({report.cpu_name()}); torch {torch.__version__}",
             f"- `python benchmarks/wrap.py`: compare_stages.py's GPT ({args.layers} blocks, dim "
             f"{args.dim}, Ψ = {psi:,}), {n} gloo ranks, AdamW fp32, {STEPS} timed steps", "",
             "| stage | units | largest unit (elements) | model states, peak (MiB) | schedule "
             "(MiB) | paper (MiB) | all-gathers / reduce-scatters per step | sent (MiB/step) "
             "| step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        lines.append(
            f"| {r['stage']} | {r['wrap']} | {r['largest_unit']:,} | "
            f"{r['model_states_peak'] / MIB:.2f} | {r['schedule']['peak'] / MIB:.2f} | "
            f"{model_state_bytes(psi, n, r['stage'], mixed_precision=False) / MIB:.2f} | "
            f"{c['all_gather']} / {c['reduce_scatter']} | {r['ledger'] / MIB:.2f} | "
            f"{1e3 * r['step_time']:.1f} |")
    root = next(r for r in rows if r["stage"] == 3 and r["wrap"] == "root")
    paper = model_state_bytes(psi, n, 3, mixed_precision=False)
    formula = paper + 8 * psi - 4 * psi / n
    lines += ["", f"Root only at ZeRO-3: measured {root['model_states_peak'] / MIB:.2f} MiB against "
              f"the paper's {paper / MIB:.2f} plus the whole model's parameters and gradients "
              f"gathered at once (4Ψ + 4Ψ = {8 * psi / MIB:.2f}) less the gradient shards not "
              f"yet formed (4Ψ/N = {4 * psi / n / MIB:.2f}): {formula / MIB:.2f} MiB (ratio "
              f"{root['model_states_peak'] / formula:.3f}; the rest is padding and AdamW's step "
              "counters)."]
    same = all(r["losses_all_ranks"] == rows[0]["losses_all_ranks"] for r in rows)
    lines += ["", f"Losses of every row {'agree bitwise' if same else 'DIFFER'}."]
    text = "\n".join(lines) + "\n"
    print(text)
    base = os.path.join(os.path.dirname(__file__), "results",
                        f"{datetime.date.today()}-{report.machine()}-wrap")
    open(base + ".md", "w").write(text)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, stage in zip(axes, STAGES):
        mine = [r for r in rows if r["stage"] == stage]
        ax.bar([r["wrap"] for r in mine], [r["model_states_peak"] / MIB for r in mine])
        ax.axhline(model_state_bytes(psi, n, stage, mixed_precision=False) / MIB, color="k",
                   ls="--", lw=1, label="paper")
        ax.set_title(f"ZeRO-{stage}: model states per rank, peak")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=110)


if __name__ == "__main__":
    main()
