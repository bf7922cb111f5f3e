"""The plan against measured runs: ``compare_stages.py --model`` for several architectures and
world sizes, one results file with every predicted figure beside the measured one.

    python benchmarks/plan_check.py                  # 5 models x N = 2, 4 on CPU ranks, ~4 min
    python benchmarks/plan_check.py --world-sizes 2 --models benchmarks/configs/tiny-bert.json

The targets (notes/19-plan.md): model states within 1% of the measured, peak within 10%,
and bytes sent equal to the prediction (every system's count at the dispatcher; for ours also
the ledger less the ranks' agreements). Run it without ZERO_CHECK=1, which agrees before every
collective: the plan counts the one agreement a step of the default.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_stages  # noqa: E402
import report  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = [os.path.relpath(os.path.join(HERE, "configs", f), os.getcwd())
          for f in ("tiny-llama.json", "tiny-mixtral.json", "tiny-bert.json")]
if importlib.util.find_spec("torchtitan") is not None:  # the [titan] extra
    MODELS.append("torchtitan:llama3:debugmodel")
MODELS.append("zerolab.planmodel:gpt_deep")


def run(model: str, n: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        with contextlib.redirect_stdout(io.StringIO()):
            compare_stages.main(["--model", model, "--world-size", str(n), "--no-time",
                                 "--out", os.path.join(tmp, "r.md"), "--json", out, *extra])
        return json.load(open(out))


def lines_for(model: str, n: int, rows: list[dict]) -> tuple[list[str], list[tuple]]:
    out = [f"### {model}, N = {n}", "",
           "| system | model states MiB: measured / predicted (ratio) | peak MiB: measured / "
           "predicted (ratio) | bytes sent: measured / predicted | ours: ledger less agreements |",
           "|---|---|---|---|---|"]
    errors = []
    for r in rows:
        p = r["predicted"]
        s = p["model_state_bytes_per_rank"] / r["model_state_bytes_per_rank"]
        k = p["peak_bytes_per_rank"] / r["peak_bytes_per_rank"]
        ledger = "-"
        equal = r["bytes_sent_per_rank_per_step"] == p["bytes_sent_per_rank_per_step"]
        if r["ledger_bytes_per_rank_per_step"] is not None:
            less = r["ledger_bytes_per_rank_per_step"] - r["agreement_bytes_per_rank_per_step"]
            same = less == p["bytes_sent_per_rank_per_step"] - p["agreement_bytes_per_rank_per_step"]
            ledger = f"{less:,} ({'equal' if same else 'differs'})"
            equal = equal and same
        out.append(f"| {r['system']} | {r['model_state_bytes_per_rank'] / 2**20:.3f} / "
                   f"{p['model_state_bytes_per_rank'] / 2**20:.3f} ({s:.4f}) | "
                   f"{r['peak_bytes_per_rank'] / 2**20:.3f} / {p['peak_bytes_per_rank'] / 2**20:.3f} "
                   f"({k:.4f}) | {r['bytes_sent_per_rank_per_step']:,} / "
                   f"{p['bytes_sent_per_rank_per_step']:,} | {ledger} |")
        errors.append((r["system"], s, k, equal))
    return out + [""], errors


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--mixed-precision", action="store_true")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   choices=("full", "selective"))
    p.add_argument("--out", default=None, help="default benchmarks/results/<date>-<machine>-plan.md")
    args = p.parse_args(argv)
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(HERE, "results", f"{date}-{report.machine()}-plan.md")
    extra = ["--mixed-precision"] if args.mixed_precision else []
    extra += ([f"--activation-checkpointing={args.activation_checkpointing}"]
              if args.activation_checkpointing else [])
    os.environ["ZERO_CHECK"] = "0"  # the default's one agreement a step, which the plan counts
    body, every = [], []
    for model in args.models.split(","):
        for n in map(int, args.world_sizes.split(",")):
            start = time.monotonic()
            lines, errors = lines_for(model, n, run(model, n, extra))
            body += lines
            every += errors
            print(f"{model} N={n}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    worst_s = max(abs(s - 1) for _, s, _, _ in every)
    worst_k = max(abs(k - 1) for _, _, k, _ in every)
    exact = [e for *_, e in every]
    each = " ".join(["compare_stages.py --model MODEL --world-size N --no-time", *extra])
    head = [f"# The plan against measured runs, {date}", "",
            f"- machine: {report.machine()} ({report.cpu_name()}), CPU ranks (gloo)",
            f"- torch {torch.__version__}",
            f"- command: `python benchmarks/plan_check.py {' '.join(argv or sys.argv[1:])}`",
            f"- each run: `{each}` (batch {compare_stages.BATCH} x seq {compare_stages.SEQ} per "
            f"rank, AdamW, "
            f"{'bf16 / fp32 reduce' if args.mixed_precision else 'fp32'}"
            f"{f', {args.activation_checkpointing} checkpointing' if args.activation_checkpointing else ''})",
            "",
            f"Over {len(every)} rows: model states within {100 * worst_s:.3f}% of measured, "
            f"peak within {100 * worst_k:.2f}%; bytes sent equal to the prediction in "
            f"{sum(exact)} of {len(exact)} rows (ours: the whole count and the ledger less "
            f"agreements both).", ""]
    text = "\n".join(head + body)
    print(text)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
