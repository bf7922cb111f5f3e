"""One training step per system, traced: when each unit computes, when each collective runs.

    python benchmarks/timeline.py     # ~20 s: traces in benchmarks/results/timeline/, a PNG in notes/figures/
    python benchmarks/timeline.py --emulated RESULTS.trace.json --match "4x128, 2 ranks, dgx-h100,"
        # the emulated GPU timelines that compare_stages.py --network wrote, drawn

Each system trains the default GPT of compare_stages.py on 2 CPU ranks; the third step is
recorded with torch.profiler on every rank. Rank 0's Chrome trace is saved (open it in
https://ui.perfetto.dev), and a PNG draws, per system, the main thread (each unit's forward,
the backward, the optimizer) above the lanes of its collectives:

- for our stages, each collective of the ledger as a span from the moment it was issued
  (``Record.time``) to the moment this rank's ``wait()`` for it returned (``Record.done``):
  how long the rank had it in flight. Spans that overlap go on lanes of their own, so the
  number of lanes is the most collectives in flight at once. The Chrome trace carries the
  same spans on a thread named "zero ledger: issued -> wait() returned";
- for every system, the gloo threads, which run the collectives' work: when gloo actually
  moved and reduced the bytes (the profiler's ``gloo:`` events).

What ``done`` means depends on the backend. On gloo, ``wait()`` returns when the collective
has finished on this rank, so a span is the time the collective was in flight. Under NCCL,
``wait()`` only makes the current CUDA stream wait for the collective's stream and returns at
once; a span would then end when the CPU queued that dependency, and the GPU timeline (the
profiler's NCCL kernels) is the one to read.

The root's own forward (embeddings, head) is the gap before the first block and after the last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_stages as cs  # noqa: E402
from argtypes import comma_list, output_file, positive_int  # noqa: E402

import zero  # noqa: E402
from zerolab.launch import run_ranks  # noqa: E402
from zerolab.models import GPT, GPTConfig  # noqa: E402
from zerolab.systems import KINDS as ALL_KINDS, System  # noqa: E402

KINDS = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
HERE = os.path.dirname(os.path.abspath(__file__))
COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
           "all_gather": "#8172b3", "all_reduce": "#c44e52", "reduce_scatter": "#c44e52",
           "broadcast": "#937860", "agree": "#bbbbbb"}
LEDGER = "zero ledger: issued -> wait() returned"  # a thread of its own in the Chrome trace
LEDGER_TID = 999_999


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
    with profile(activities=[ProfilerActivity.CPU]) as prof, zero.Ledger() as ledger:
        with record_function("zero::t0"):  # ties perf_counter to the profiler's clock
            t0 = time.perf_counter()
        system.step(rank, 2, batch=cs.BATCH)
    if rank != 0:
        return None
    path = os.path.join(tmp, f"{kind}.json")
    prof.export_chrome_trace(path)
    add_ledger(path, t0, ledger.records)
    return path


def add_ledger(path: str, t0: float, records) -> None:
    """Write each ledger record into the Chrome trace: a span from issue to wait() returned."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    mark = next(e for e in events if e.get("name") == "zero::t0")
    pid = mark["pid"]
    for r in records:
        if r.done is None:
            continue
        events.append({"ph": "X", "cat": "zero_ledger", "pid": pid, "tid": LEDGER_TID,
                       "name": f"{r.op} {r.unit}".strip(),
                       "ts": mark["ts"] + 1e6 * (r.time - t0), "dur": 1e6 * (r.done - r.time),
                       "args": {"phase": r.phase, "buffer_bytes": r.buffer_bytes,
                                "sent_bytes": r.sent_bytes, "group": r.group,
                                "dtype": str(r.dtype)}})
    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": LEDGER_TID,
                   "args": {"name": LEDGER}})
    with open(path, "w") as f:
        json.dump(trace, f)


def lanes(path: str) -> dict[str, list[tuple]]:
    """{lane: [(start ms, duration ms, kind, label[, sub-row, sub-rows])]} from a Chrome trace."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in events if e.get("cat") != "zero_ledger")
    threads = [e["tid"] for e in events if e["tid"] != LEDGER_TID]
    main = max(set(threads), key=threads.count)
    out: dict[str, list] = {"main thread": []}
    backward, ledger = [], []
    for e in events:
        start, dur, name = (e["ts"] - t0) / 1e3, e["dur"] / 1e3, e["name"]
        if e["tid"] == LEDGER_TID:
            op, _, unit = name.partition(" ")
            ledger.append((start, dur, op, unit))
        elif e["tid"] == main and name.startswith("forward "):
            out["main thread"].append((start, dur, "forward", name[8:]))
        elif e["tid"] == main and name.startswith("autograd::engine::evaluate_function"):
            backward.append((start, dur))
        elif e["tid"] == main and name.startswith("Optimizer.step"):
            out["main thread"].append((start, dur, "optimizer", "step"))
        elif name.startswith("gloo:"):
            op = name[5:]
            out.setdefault(f"gloo thread {e['tid']:>12}", []).append((start, dur, op, ""))
    threads = sorted(k for k in out if k.startswith("gloo thread "))
    for i, old in enumerate(threads, 1):  # thread ids differ between runs: number them
        out[f"gloo thread {i}"] = out.pop(old)
    for start, end in _merge(backward, gap=0.05):
        out["main thread"].append((start, end - start, "backward", ""))
    if ledger:  # one row; collectives in flight at once share it, each on a sub-row
        packed = _pack(ledger)
        out["in flight (ledger)"] = [(*span, i, len(packed))
                                     for i, lane in enumerate(packed) for span in lane]
    return dict(sorted(out.items(), key=lambda kv: not kv[0].startswith(("main", "in flight"))))


def _pack(spans):
    """Spans on as few lanes as keep each lane's spans apart (the first lane that is free)."""
    lanes_: list[list] = []
    for span in sorted(spans):
        for lane in lanes_:
            last = lane[-1]
            if last[0] + last[1] <= span[0]:
                lane.append(span)
                break
        else:
            lanes_.append([span])
    return lanes_


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
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(rows) + 1.6))
    for y, (kind, lane) in enumerate(reversed(rows)):
        for start, dur, what, label, *sub in per_kind[kind][lane]:
            row, rows_ = sub or (0, 1)
            height = 0.8 / rows_
            centre = y + 0.4 - height * (row + 0.5)  # the first sub-row on top
            ax.barh(centre, max(dur, 0.15), left=start, color=COLOURS.get(what, "gray"),
                    edgecolor="white", linewidth=0.3, height=height)
            big = dur > (3 if what == "forward" else 5)
            if label and big and (what == "forward" or rows_ <= 3):
                ax.text(start + dur / 2, centre, label.replace("blocks.", "b"), ha="center",
                        va="center", fontsize=6 if rows_ == 1 else 5, color="white")
    for y, (kind, lane) in enumerate(reversed(rows)):
        if lane == "main thread" and y + 1 < len(rows):
            ax.axhline(y + 0.5, color="#999999", linewidth=0.6)
    ax.set_yticks(range(len(rows)), [f"{k}: {lane}" for k, lane in reversed(rows)], fontsize=7.5)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("ms since the step began (rank 0). in flight: each of zero's collectives from "
                  "its issue to the return of its wait(), one sub-row per collective in flight "
                  "at once; gloo threads: when gloo did the work", fontsize=8)
    names = ["forward (per unit)", "backward", "optimizer", "all-gather",
             "reduce-scatter / all-reduce", "broadcast", "agree"]
    kinds = ["forward", "backward", "optimizer", "all_gather", "reduce_scatter", "broadcast",
             "agree"]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds]
    ax.legend(handles, names, fontsize=7, ncol=7, loc="lower center",
              bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.subplots_adjust(left=max(fig.subplotpars.left, 0.13))
    fig.savefig(png, dpi=130)


def emulated_lanes(path: str, match: str) -> dict:
    """{process name: {track: [(start, dur, what)]}} from an emulated Chrome trace
    (zerolab/emulate.py, as compare_stages.py --network writes it), the processes whose name
    contains ``match``, in GPU microseconds."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and match in e["args"]["name"]}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("name") == "thread_name" and e["pid"] in procs}
    out: dict = {name: {} for name in procs.values()}
    for e in events:
        if e["ph"] == "X" and e["pid"] in procs:
            what = e["name"].removeprefix("wait ")
            what = "wait" if e["name"].startswith("wait") else what
            out[procs[e["pid"]]].setdefault(tracks[(e["pid"], e["tid"])], []).append(
                (e["ts"], e["dur"], what))
    return out


EMULATED_COLOURS = {"compute": "#4c72b0", "wait": "#222222", "all_gather": "#8172b3",
                    "reduce_scatter": "#c44e52", "all_reduce": "#dd8452", "broadcast": "#937860",
                    "all_to_all": "#55a868"}


def draw_emulated(per_system: dict, png: str, title: str) -> None:
    """One row per stream of each system (the computing stream first): compute, the waits of
    the computing stream (black: exposed), and each collective from its start to its finish."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, track) for name, tracks in per_system.items()
            for track in sorted(tracks, key=lambda t: (t != "compute", t))]
    fig, ax = plt.subplots(figsize=(14, 0.38 * len(rows) + 1.6))
    for y, (name, track) in enumerate(reversed(rows)):
        spans = per_system[name][track]  # (side streams' copies first: collectives on top)
        for start, dur, what in sorted(spans, key=lambda x: x[2] != "compute"):
            ax.barh(y, max(dur, 0.01), left=start, height=0.7, linewidth=0,
                    color=EMULATED_COLOURS.get(what, "gray"))
        if track == "compute" and y + 1 < len(rows):
            ax.axhline(y + 0.5, color="#999999", linewidth=0.6)
    ax.set_yticks(range(len(rows)), [f"{n.split(',')[0]}: {t}" for n, t in reversed(rows)],
                  fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"GPU microseconds since the step began (rank 0, emulated): {title}",
                  fontsize=8)
    kinds = list(EMULATED_COLOURS)
    handles = [plt.Rectangle((0, 0), 1, 1, color=EMULATED_COLOURS[k]) for k in kinds]
    ax.legend(handles, ["compute", "computing stream waits (exposed)", *kinds[2:]], fontsize=7,
              ncol=len(kinds), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=comma_list(ALL_KINDS), default=KINDS,
                   help=f"comma list of {ALL_KINDS}")
    p.add_argument("--dim", type=positive_int, default=cs.DIM,
                   help=f"a multiple of {cs.HEADS} (heads)")
    p.add_argument("--layers", type=positive_int, default=cs.LAYERS)
    p.add_argument("--png", type=output_file,
                   default=os.path.join(HERE, "..", "notes", "figures", "timeline.png"))
    p.add_argument("--emulated", default=None, metavar="TRACE",
                   help="instead: draw the emulated timelines of a trace that compare_stages.py "
                        "--network wrote (.trace.json), the processes whose name has --match")
    p.add_argument("--match", default="", help="with --emulated: e.g. '4x128, 2 ranks, dgx-h100'")
    args = p.parse_args(argv)
    if args.emulated:
        per_system = emulated_lanes(args.emulated, args.match)
        if not per_system:
            p.error(f"no process of {args.emulated} has {args.match!r} in its name")
        draw_emulated(per_system, args.png, args.match or os.path.basename(args.emulated))
        print(f"wrote {args.png}")
        return
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
