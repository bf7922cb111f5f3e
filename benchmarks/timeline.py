"""One training step per system, traced: when each unit computes, when each collective runs.

    python benchmarks/timeline.py     # ~20 s: traces in benchmarks/results/timeline/, a PNG in notes/figures/

Each system trains the default GPT of compare_stages.py on 2 CPU ranks; the third step is
recorded with torch.profiler on every rank. Rank 0's Chrome trace is saved (open it in
https://ui.perfetto.dev), and a PNG draws, per system, the main thread (each unit's forward,
the backward, the optimizer) above the gloo threads that run the collectives: what overlaps
with what. The root's own forward (embeddings, head) is the gap before the first block and
after the last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import warnings

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_stages as cs  # noqa: E402
from argtypes import comma_list, output_file, positive_int  # noqa: E402

from zerolab.launch import run_ranks  # noqa: E402
from zerolab.models import GPT, GPTConfig  # noqa: E402
from zerolab.systems import KINDS as ALL_KINDS, System  # noqa: E402

KINDS = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
HERE = os.path.dirname(os.path.abspath(__file__))
COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
           "all_gather": "#8172b3", "all_reduce": "#c44e52", "reduce_scatter": "#c44e52",
           "broadcast": "#937860"}


def trace(rank: int, n: int, kind: str, tmp: str, dim: int, layers: int) -> str | None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=cs.VOCAB, seq=cs.SEQ, dim=dim, layers=layers, heads=cs.HEADS))
    system = System(kind, base, "adamw")
    for i in range(2):
        system.step(rank, i, batch=cs.BATCH)
    model = getattr(system.model, "module", system.model)  # DDP (and ddp+zro) wraps it
    spans = {}  # a named range around each unit's forward, from the outside

    def enter(name):
        def hook(mod, args):
            spans[name] = record_function(f"forward {name}")
            spans[name].__enter__()
        return hook

    def leave(name):
        def hook(mod, args, out):
            spans.pop(name).__exit__(None, None, None)
        return hook

    for unit in base.units():
        name = next(p for p, m in base.named_modules() if m is unit)
        if not name:
            continue  # the root's forward encloses all the others: its own work is the gaps
        mod = model.get_submodule(name)
        mod.register_forward_pre_hook(enter(name))
        mod.register_forward_hook(leave(name))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        system.step(rank, 2, batch=cs.BATCH)
    if rank != 0:
        return None
    path = os.path.join(tmp, f"{kind}.json")
    prof.export_chrome_trace(path)
    return path


def lanes(path: str) -> dict[str, list[tuple[float, float, str, str]]]:
    """{lane: [(start ms, duration ms, kind, label)]} from a Chrome trace."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in events)
    main = max({e["tid"] for e in events}, key=lambda t: sum(e["tid"] == t for e in events))
    out: dict[str, list] = {"main thread": []}
    backward = []
    for e in events:
        start, dur, name = (e["ts"] - t0) / 1e3, e["dur"] / 1e3, e["name"]
        if e["tid"] == main and name.startswith("forward "):
            out["main thread"].append((start, dur, "forward", name[8:]))
        elif e["tid"] == main and name.startswith("autograd::engine::evaluate_function"):
            backward.append((start, dur))
        elif e["tid"] == main and name.startswith("Optimizer.step"):
            out["main thread"].append((start, dur, "optimizer", "step"))
        elif name.startswith("gloo:"):
            op = name[5:]
            out.setdefault(f"gloo thread {e['tid']}", []).append(
                (start, dur, op, ""))
    for start, end in _merge(backward, gap=0.05):
        out["main thread"].append((start, end - start, "backward", ""))
    return out


def _merge(spans, gap):
    merged = []
    for start, dur in sorted(spans):
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], start + dur)
        else:
            merged.append([start, start + dur])
    return merged


def draw(per_kind: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(kind, lane) for kind, ls in per_kind.items() for lane in ls]
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.2))
    for y, (kind, lane) in enumerate(reversed(rows)):
        for start, dur, what, label in per_kind[kind][lane]:
            ax.barh(y, dur, left=start, color=COLOURS.get(what, "gray"), edgecolor="white",
                    linewidth=0.3)
            if label and what == "forward" and dur > 3:
                ax.text(start + dur / 2, y, label.replace("blocks.", "b"), ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)), [f"{k}: {lane}" for k, lane in reversed(rows)], fontsize=8)
    ax.set_xlabel("ms since the step began (rank 0)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()][:6]
    ax.legend(handles, ["forward (per unit)", "backward", "optimizer", "all-gather",
                        "reduce-scatter / all-reduce", "broadcast"], fontsize=7, ncol=6,
              loc="upper center", bbox_to_anchor=(0.5, 1.08))
    fig.tight_layout()
    fig.savefig(png, dpi=130)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=comma_list(ALL_KINDS), default=KINDS,
                   help=f"comma list of {ALL_KINDS}")
    p.add_argument("--dim", type=positive_int, default=cs.DIM,
                   help=f"a multiple of {cs.HEADS} (heads)")
    p.add_argument("--layers", type=positive_int, default=cs.LAYERS)
    p.add_argument("--png", type=output_file,
                   default=os.path.join(HERE, "..", "notes", "figures", "timeline.png"))
    args = p.parse_args(argv)
    if args.dim % cs.HEADS:
        p.error(f"--dim must be a multiple of the number of heads ({cs.HEADS}), got {args.dim}")
    size = argparse.Namespace(world_size=2, seq=cs.SEQ, dim=args.dim, layers=args.layers,
                              batch=cs.BATCH, kinds=args.systems)
    if why := cs.too_big(size):
        p.error(why)
    out_dir = os.path.join(HERE, "results", "timeline")
    os.makedirs(out_dir, exist_ok=True)
    per_kind = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.systems:
            path = run_ranks(trace, 2, kind, tmp, args.dim, args.layers, timeout=300)[0]
            per_kind[kind] = lanes(path)
            with open(path, "rb") as f, gzip.open(os.path.join(out_dir, f"{kind}.json.gz"), "wb") as g:
                shutil.copyfileobj(f, g)
            print(f"{kind}: traced", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    draw(per_kind, args.png)
    print(f"wrote {out_dir}/*.json.gz and {args.png}")


if __name__ == "__main__":
    main()
