"""Tables, the results file and the plots of benchmarks/compare_stages.py."""

from __future__ import annotations

import datetime
import os
import platform

import torch

from zerolab.memory import model_state_bytes, traffic_in_psi
from zerolab.systems import stage_of as stage_number

CATEGORIES = {  # our column: MemTracker's and FSDPMemTracker's category names
    "params": ("Parameter", "Sharded Param", "Unsharded Param"),
    "grads": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "comm buffers": ("All Gather", "Reduce Scatter"),
    "other": ("Buffer", "Temp", "Other", "Inputs"),
}
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
ALL_TO_ALL = "all_to_all"  # qgZ's, a column only where a system sent some


def ops_of(rows) -> tuple[str, ...]:
    return OPS + ((ALL_TO_ALL,) if any(r["sent"].get(ALL_TO_ALL) for r in rows) else ())
MIB = 2**20


def machine() -> str:
    return f"{platform.machine()}-{os.cpu_count()}cpu"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def memory_table(rows, n, stage_of) -> list[str]:
    out = ["| system | " + " | ".join(CATEGORIES) + " | peak total | model states peak "
           "| + comm buffers | paper fp32 | paper mixed (K=12) | peak RSS |",
           "|---" * (len(CATEGORIES) + 7) + "|"]
    for r in rows:
        cats = [sum(r["peaks"].get(c, 0) for c in names) for names in CATEGORIES.values()]
        stage = stage_of[r["kind"]]
        out.append(f"| {r['kind']} | " + " | ".join(_mib(c) for c in cats) +
                   f" | {_mib(r['memory'].get('Total', 0))} | {_mib(r['model_states_peak'])} "
                   f"| {_mib(r['with_comm_peak'])} "
                   f"| {_mib(model_state_bytes(r['psi'], n, stage, False))} "
                   f"| {_mib(model_state_bytes(r['psi'], n, stage, True))} | {_mib(r['rss'])} |")
    return out


def traffic_table(rows, n, stage_of) -> list[str]:
    ops = ops_of(rows)
    out = ["| system | " + " | ".join(ops) + " | total | measured / R | paper / R | our ledger |",
           "|---" * (len(ops) + 5) + "|"]
    ring = (n - 1) / n
    for r in rows:
        per_psi = r["elements"] / (r["psi"] * ring) if ring else 0.0
        ledger = _mib(r["ledger"]) if r.get("ours", r["kind"].startswith("zero")) else "-"
        paper = traffic_in_psi(stage_of[r["kind"]])
        out.append(f"| {r['kind']} | " + " | ".join(_mib(r["sent"].get(o, 0)) for o in ops) +
                   f" | {_mib(sum(r['sent'].values()))} | {per_psi:.3f} | {paper:.0f} | {ledger} |")
    return out


def time_table(rows) -> list[str]:
    """The median step, its spread over the steps (min, max), and the ratio to DDP's; with
    several rounds, the ratio's spread over them (each round's median over DDP's)."""
    ddp = next((r for r in rows if r["kind"] == "ddp"), None)
    rounds = len(rows[0].get("rounds", [])) if rows else 0
    spread = rounds > 1 and ddp is not None
    out = ["| system | median step (ms) | min (ms) | max (ms) | vs DDP |"
           + (" vs DDP, rounds [min-max] |" if spread else ""),
           "|---|---|---|---|---|" + ("---|" if spread else "")]
    for r in rows:
        ratio = f"{r['step_time'] / ddp['step_time']:.2f}x" if ddp else "-"
        times = [t for rnd in r.get("rounds", []) for t in rnd["times"]] or [r["step_time"]]
        line = (f"| {r['kind']} | {1000 * r['step_time']:.1f} | {1000 * min(times):.1f} "
                f"| {1000 * max(times):.1f} | {ratio} |")
        if spread:
            ratios = [_median(a["times"]) / _median(b["times"])
                      for a, b in zip(r["rounds"], ddp["rounds"])]
            line += f" {min(ratios):.2f}-{max(ratios):.2f}x |"
        out.append(line)
    return out


def _median(xs) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


TARGETS = [  # (what, numerator, denominator, measure, at most): notes/06 and notes/10
    ("ZeRO-3 step time / FSDP2's", "zero3", "fsdp2", "step_time", 0.9),
    ("ZeRO-2 step time / FSDP2 no-reshard's", "zero2", "fsdp2-noreshard", "step_time", 1.0),
    ("ZeRO-1 step time / DDP's", "zero1", "ddp", "step_time", 1.10),
    ("ZeRO-1 model states / ZeroRedundancyOptimizer's", "zero1", "ddp+zro", "states", 1.0),
    ("ZeRO-2 model states / FSDP2 no-reshard's", "zero2", "fsdp2-noreshard", "states", 1.0),
    ("ZeRO-2 model states + comm buffers / FSDP2 no-reshard's", "zero2", "fsdp2-noreshard",
     "with_comm", 1.0),
    ("ZeRO-3 model states / FSDP2's", "zero3", "fsdp2", "states", 1.0),
    ("ZeRO-3 model states + comm buffers / FSDP2's", "zero3", "fsdp2", "with_comm", 1.0),
    ("ZeRO-3 peak memory / FSDP2's", "zero3", "fsdp2", "peak_total", 1.0),
]
MEASURES = {"step_time": lambda r: r["step_time"], "peak_total": lambda r: r["memory"].get("Total", 0),
            "states": lambda r: r["model_states_peak"], "with_comm": lambda r: r["with_comm_peak"]}


def targets_table(rows, n) -> list[str]:
    by = {r["kind"]: r for r in rows}
    value = MEASURES
    out = ["| ratio | measured | target |", "|---|---|---|"]
    for what, a, b, measure, most in TARGETS:
        if a in by and b in by and value[measure](by[a]) and value[measure](by[b]):
            ratio = value[measure](by[a]) / value[measure](by[b])
            out.append(f"| {what} | {ratio:.3f} | <= {most:.2f}: {'met' if ratio <= most else 'missed'} |")
    if any(r.get("trainable", r["psi"]) < r["psi"] for r in rows) and "zero3" in by and "fsdp2" in by:
        ratio = MEASURES["peak_total"](by["zero3"]) / MEASURES["peak_total"](by["fsdp2"])
        out.append(f"| fine-tuning: ZeRO-3 peak memory / FSDP2's | {ratio:.3f} | <= 1.05: "
                   f"{'met' if ratio <= 1.05 else 'missed'} |")
    for r in rows:  # the paper's formula plus the units in flight, 2% slack
        if "largest_unit" in r:
            # What the schedule holds beyond the formula, as FSDP2's does: at stage 3 two
            # units' parameters (the one computing, the one prefetched) and two full
            # gradients (the one forming, the one being reduce-scattered); below, one unit's.
            units = 2 if stage_number(r["kind"]) == 3 else 1
            bound = model_state_bytes(r["psi"], n, stage_number(r["kind"]), False) + \
                8 * units * r["largest_unit"]
            ratio = r["model_states_peak"] / bound
            what = "two units'" if units == 2 else "one unit's"
            out.append(f"| {r['kind']} model states / (paper + {what} params and grads) "
                       f"| {ratio:.3f} | <= 1.02: {'met' if ratio <= 1.02 else 'missed'} |")
    return out if len(out) > 2 else []


def formula_table(rows, n) -> list[str]:
    """Each stage's measured peak against zerolab.memory.schedule, term by term."""
    ours = [r for r in rows if "schedule" in r]
    if not ours:
        return []
    out = ["| system | paper formula | at rest (+ padding, step counters) | + units in flight "
           "| = schedule | measured | measured / schedule |", "|---" * 7 + "|"]
    for r in ours:
        s = r["schedule"]
        paper = model_state_bytes(r["psi"], n, stage_number(r["kind"]), False)
        out.append(f"| {r['kind']} | {_mib(paper)} | {_mib(s['at_rest'])} | {_mib(s['in_flight'])} "
                   f"| {_mib(s['peak'])} | {_mib(r['model_states_peak'])} "
                   f"| {r['model_states_peak'] / s['peak']:.4f} |")
    for r in rows:
        if r.get("variant"):  # the formula walks the default schedule, not a variant's
            out.append(f"| {r['kind']} | n/a | n/a | n/a | n/a | {_mib(r['model_states_peak'])} "
                       f"| n/a |")
    return out


def loss_check(rows) -> str:
    """Do all systems' losses agree, on every rank and step? Bitwise is expected at N = 2."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("precision", "fp32"), []).append(r)
    lines = []
    for prec, group in groups.items():
        ref = torch.tensor(group[0].get("losses_all_ranks", [group[0]["losses"]]), dtype=torch.float64)
        worst = 0.0
        for r in group[1:]:
            other = torch.tensor(r.get("losses_all_ranks", [r["losses"]]), dtype=torch.float64)
            worst = max(worst, ((other - ref).abs() / ref.abs()).max().item())
        names = ", ".join(r["kind"] for r in group)
        verdict = "agree bitwise" if worst == 0.0 else f"agree to a relative {worst:.1e}"
        lines.append(f"Losses ({prec}: {names}) {verdict} over {ref.numel()} (rank, step) values.")
    return "\n".join(lines)


def write(rows, args, argv, stage_of) -> None:
    date = datetime.date.today().isoformat()
    suffix = "-sweep" if args.sweep else "-frozen" if getattr(args, "frozen", False) else ""
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"{date}-{machine()}{suffix}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for r in rows:
        r["precision"] = "bf16" if args.mixed_precision and not r["kind"].startswith("ddp") else "fp32"
        if r.get("own_precision"):  # a variant with a precision policy of its own
            r["precision"] = f"{r['kind']}'s own mp_policy"
    head = [
        f"# Stage comparison{' sweep' if args.sweep else ''}, {date}", "",
        f"- machine: {machine()} ({cpu_name()}), device {args.device}",
        f"- torch {torch.__version__}, world size {args.world_size}",
        f"- command: `python {' '.join(argv)}`",
    ]
    if args.sweep:
        body = sweep_tables(rows, stage_of)
    else:
        n, psi = args.world_size, rows[0]["psi"]
        if args.frozen:
            trainable = rows[0].get("trainable", 0)
            head += [f"- model: LoRA-style fine-tuning, {args.layers} blocks of a frozen "
                     f"{args.dim}x{args.dim} base and a trainable rank-8 adapter, and a trainable "
                     f"head; batch {args.batch} per rank, Ψ = {psi:,} parameters ({trainable:,} "
                     f"trainable); AdamW on the trainable ones, fp32. The paper columns assume "
                     f"every parameter trains: they do not apply here"]
        elif getattr(args, "model", None):
            head += [f"- model: {args.model} (built as python -m zerolab plan builds it: its "
                     f"repeated blocks the units), seq {args.seq}, batch {args.batch} per rank, "
                     f"Ψ = {psi:,} parameters; AdamW, "
                     f"{'bf16 params / fp32 reduce' if args.mixed_precision else 'fp32'}"]
        else:
            head += [f"- model: GPT, {args.layers} layers, dim {args.dim}, seq {args.seq}, "
                     f"batch {args.batch} per rank, Ψ = {psi:,} parameters; AdamW, "
                     f"{'bf16 params / fp32 reduce' if args.mixed_precision else 'fp32'}"]
        body = ["", "## Memory per rank (MiB; the largest rank; MemTracker: each category's own peak, then the peak total)", "",
                *memory_table(rows, n, stage_of), "",
                "## Bytes sent per rank per step (MiB; counted at the dispatcher, ring accounting)", "",
                "R = 4 x Ψ x (N-1)/N bytes, what one rank sends in an all-gather of every fp32 "
                "parameter (notes/00-start-here.md); measured / R counts elements.", "",
                *traffic_table(rows, n, stage_of)]
        if all(r["step_time"] for r in rows):
            rounds = getattr(args, "rounds", 1)
            of = f"{args.steps} steps" + (f" x {rounds} rounds, systems interleaved"
                                          if rounds > 1 else "")
            body += ["", f"## Step time (median of {of}, slowest rank)", "",
                     *time_table(rows)]
        if getattr(args, "emulation", None):
            body += emulated_tables(rows, args)
        if formula := formula_table(rows, n):
            body += ["", "## Model states against the formula (MiB; zerolab/memory.py: schedule)", "",
                     "The paper's formula on our padded sizes, AdamW's 4-byte step counter per "
                     "parameter piece, and the units in flight at the worst instant of our "
                     "schedule (a unit gathered while another computes; two full gradients, "
                     "one forming while the one before it is reduce-scattered):", "", *formula]
        if targets := targets_table(rows, n):
            body += ["", "## Targets", "", "Model states count parameters, gradients and "
                     "optimizer state (not the step's temporaries) on the largest rank. FSDP2's "
                     "tracker files the units it has in flight (all-gather outputs, "
                     "reduce-scatter inputs) as comm buffers, while ours are the parameter and "
                     "gradient storage itself: \"+ comm buffers\" compares the two alike"
                     + ("; a comm policy's own buffers on the wire (qwZ's messages, qgZ's "
                        "all-to-all) are comm buffers too (zerolab/trackers.py)."
                        if any(r["kind"] in ("zero3-qwz", "zero3-qgz") for r in rows)
                        else "."), "", *targets]
        body += getattr(args, "extra", [])
        body += ["", loss_check(rows)]
        for r in rows:
            if r.get("disk"):
                body += ["", f"{r['kind']}: MemTracker does not see the optimizer state in "
                         f"memory during the step (disk offload makes its buffers on its own I/O "
                         f"thread); the store counts {_mib(r['disk']['held'])} MiB held at once "
                         f"at most, and {_mib(r['disk']['moved'])} MiB read and as much written "
                         "a step."]
        if bad := {r["kind"]: r["unaccounted"] for r in rows if r["unaccounted"]}:
            body += ["", f"Collectives not accounted in bytes: {bad}"]
    if getattr(args, "emulation", None):
        trace = getattr(args, "trace", None) or out.removesuffix(".md") + ".trace.json"
        where = os.path.relpath(write_trace(rows, args, trace),
                                os.path.dirname(os.path.abspath(out)))
        body += ["", f"Emulated timelines (rank 0's median step of each system's last round, "
                     f"GPU microseconds; open in https://ui.perfetto.dev): `{where}`"]
    text = "\n".join(head + body) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)
    png = plot(rows, out, args, stage_of)
    print(f"wrote {out}" + (f" and {png}" if png else ""))


def sweep_tables(rows, stage_of) -> list[str]:
    out = ["", "## Model-state peak per rank (MiB) and bytes sent per step (MiB)", "",
           "| Ψ | N | system | model states peak | paper fp32 | sent per step | measured / R |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        n, ring = r["world_size"], (r["world_size"] - 1) / r["world_size"]
        per_psi = f"{r['elements'] / (r['psi'] * ring):.3f}" if ring else "-"
        out.append(f"| {r['psi']:,} | {n} | {r['kind']} | {_mib(r['model_states_peak'])} "
                   f"| {_mib(model_state_bytes(r['psi'], n, stage_of[r['kind']], False))} "
                   f"| {_mib(sum(r['sent'].values()))} | {per_psi} |")
    return out


def plot(rows, out, args, stage_of) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return None
    png = out.removesuffix(".md") + ".png"
    if args.sweep:
        _plot_sweep(plt, rows, stage_of)
    else:
        _plot_stages(plt, rows, args.world_size, stage_of)
    plt.savefig(png, dpi=120)
    plt.close("all")
    return png


def _plot_stages(plt, rows, n, stage_of) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    kinds = [r["kind"] for r in rows]
    x = range(len(rows))
    _stacked(axes[0], kinds, {c: [sum(r["memory"].get(k, 0) for k in names) / MIB for r in rows]
                              for c, names in CATEGORIES.items()})
    axes[0].set_title(f"memory per rank at the peak total (MiB), N={n}")
    measured = [r["model_states_peak"] / MIB for r in rows]
    paper = [model_state_bytes(r["psi"], n, stage_of[r["kind"]], False) / MIB for r in rows]
    axes[1].bar([i - 0.2 for i in x], measured, width=0.4, label="measured peak")
    axes[1].bar([i + 0.2 for i in x], paper, width=0.4, label="paper, fp32 Adam")
    axes[1].set_xticks(list(x), kinds)
    axes[1].set_title("model states (params + grads + optimizer), MiB")
    axes[1].legend(fontsize=8)
    _stacked(axes[2], kinds, {op: [r["sent"].get(op, 0) / MIB for r in rows] for op in ops_of(rows)})
    axes[2].set_title("bytes sent per rank per step (MiB)")
    if all(r["step_time"] for r in rows):
        axes[3].bar(kinds, [1000 * r["step_time"] for r in rows], color="gray")
    axes[3].set_title("median step time (ms)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=35, labelsize=8)
    fig.tight_layout()


def _stacked(ax, labels, series: dict) -> None:
    bottom = [0.0] * len(labels)
    for name, vals in series.items():
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.legend(fontsize=8)


def _plot_sweep(plt, rows, stage_of) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    biggest = max(r["psi"] for r in rows)
    for kind in dict.fromkeys(r["kind"] for r in rows):
        pts = sorted((r["world_size"], r["model_states_peak"]) for r in rows
                     if r["kind"] == kind and r["psi"] == biggest)
        line = axes[0].plot([p[0] for p in pts], [p[1] / MIB for p in pts], "o-", label=kind)[0]
        axes[0].plot([p[0] for p in pts],
                     [model_state_bytes(biggest, p[0], stage_of[kind], False) / MIB for p in pts],
                     "--", color=line.get_color(), alpha=0.6)
        pts = sorted((r["psi"], sum(r["sent"].values())) for r in rows
                     if r["kind"] == kind and r["world_size"] == max(x["world_size"] for x in rows))
        axes[1].plot([p[0] for p in pts], [p[1] / MIB for p in pts], "o-", label=kind)
    sizes = sorted({r["world_size"] for r in rows})
    axes[0].set(xscale="log", yscale="log", xlabel="world size N",
                title=f"model-state peak per rank (MiB), Ψ={biggest:,}; dashed: paper")
    axes[0].set_xticks(sizes, [str(x) for x in sizes])
    axes[1].set(xscale="log", yscale="log", xlabel="parameters Ψ",
                title=f"bytes sent per rank per step (MiB), N={sizes[-1]}")
    for ax in axes:
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()


# ---- the emulated GPU cluster (--network; zerolab/emulate.py) -----------------------------

EMULATED_TARGETS = [  # (what, numerator, denominator, measure, at most): issue 46, notes/10
    ("ZeRO-3 exposed communication / FSDP2's", "zero3", "fsdp2", "exposed_s", 1.0),
    ("ZeRO-2 exposed communication / FSDP2 no-reshard's", "zero2", "fsdp2-noreshard",
     "exposed_s", 1.0),
    ("ZeRO-1 exposed communication / DDP's", "zero1", "ddp", "exposed_s", 1.05),
    ("ZeRO-3 step time / FSDP2's", "zero3", "fsdp2", "step_s", 0.95),
]
EXPOSED_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _spread(values, fmt) -> str:
    """median [min-max] of a figure over the rounds."""
    values = sorted(values)
    mid = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
    if len(values) == 1:
        return fmt(mid)
    return f"{fmt(mid)} [{fmt(values[0])}-{fmt(values[-1])}]"


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else float("inf"))


def emulated_tables(rows, args) -> list[str]:
    """Per network: each system's emulated step, compute, exposed communication by kind and
    overlap (median [min-max] over rounds), the targets' ratios round by round, the ranking,
    and the plan's exposed communication beside the emulated one."""
    emu = args.emulation
    out = []
    ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
    steps = f"{args.steps} steps x {args.rounds} round{'s' if args.rounds > 1 else ''}"
    clock = emu.get("clock", "kernels")
    for spec, info in emu["networks"].items():
        d = info["dilation"]
        what = {"kernels": "the CPU time inside aten operators (the host's Python left out)",
                "process": "all of the process's CPU time"}.get(clock)
        how = (f"Dilation {d:.1f}: this CPU's compute for one step, {ms(emu['cpu_step_s'])} ms "
               f"(forward, backward and AdamW on one rank's batch; {what}), over the GPU's, "
               f"{ms(info['gpu_step_s'])} ms (zerolab/roofline.py, the plan's, on its GPU). "
               f"Every collective lasts what zerolab/cost.py prices it at on these links, times "
               f"the dilation; compute is this CPU's, measured: {what} (zerolab/emulate.py). "
               f"Emulated ms are the CPU's scale (a GPU's: divide by {d:.1f})." if what else
               f"Compute: each operator priced on the GPU by the plan's roofline "
               f"(zerolab/roofline.py; {ms(info['gpu_step_s'])} ms a plain step), collectives "
               f"by zerolab/cost.py on these links; no dilation, emulated ms are a GPU's "
               f"(this CPU's kernels took {info['cpu_gpu']:.1f} x as long).")
        out += ["", f"## Emulated GPU cluster: {spec}", "",
                f"{info['cluster']}. {how} Each figure the median of {steps}, and [min-max] over "
                f"the rounds. Exposed: time the computing stream waited for a collective of that "
                f"kind; overlap: 1 - exposed / the collectives' summed durations. Not emulated: "
                f"compute slowed by NCCL sharing the SMs and memory bandwidth, launch overhead, "
                f"the host's own time: it is taken to run ahead of the GPU, every stream's work "
                f"starting once the waits it was told allow (notes/10-overlap.md). zero's "
                f"agreement and used-parameter flags are host metadata, read on the host (a "
                f"gloo group): off the device's timeline, as the host's time is; priced as on "
                f"these links they take {_host(rows, spec)} a step (notes/10-overlap.md).", "",
                "| system | step ms | GPU step ms | compute ms | side streams ms | "
                + " | ".join(f"exposed {k}" for k in EXPOSED_KINDS)
                + " | exposed total ms | comm ms | overlap |", "|---" * 12 + "|"]
        for r in rows:
            rounds = r["emulated"][spec]
            med = lambda key: _spread([x[key] for x in rounds], ms)  # noqa: E731
            out.append(
                f"| {r['kind']} | {med('step_s')} | "
                f"{_spread([x['step_s'] / d for x in rounds], lambda v: f'{1e3 * v:.3f}')} | "
                f"{med('compute_s')} | {med('side_compute_s')} | "
                + " | ".join(_spread([x["exposed"].get(k, 0.0) for x in rounds], ms)
                             for k in EXPOSED_KINDS)
                + f" | {med('exposed_s')} | {med('comm_s')} | "
                f"{_spread([x['overlap'] for x in rounds], lambda v: f'{100 * v:.0f}%')} |")
        out += ["", *emulated_targets(rows, spec), "", ranking(rows, spec)]
        if clock != "roofline" and all(r.get("emulated_roofline") for r in rows):
            out += ["", *roofline_clock(rows, spec)]
        if info.get("plan"):
            out += ["", *plan_beside(rows, spec, info)]
    return out


def _host(rows, spec) -> str:
    """The host metadata's collectives a step (emulated ms, the CPU's scale), per system."""
    each = [(r["kind"], max(x.get("host", 0.0) for x in r["emulated"][spec])) for r in rows]
    return ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in each if v) or "nothing"


def emulated_targets(rows, spec) -> list[str]:
    by = {r["kind"]: r["emulated"][spec] for r in rows}
    out = ["| ratio (emulated) | median [min-max] over rounds | target | every round |",
           "|---|---|---|---|"]
    for what, a, b, key, most in EMULATED_TARGETS:
        if a in by and b in by:
            ratios = [_ratio(x[key], y[key]) for x, y in zip(by[a], by[b])]
            verdict = "met" if sorted(ratios)[(len(ratios) - 1) // 2] <= most else "missed"
            every = "yes" if all(v <= most for v in ratios) else "no"
            out.append(f"| {what} | {_spread(ratios, lambda v: f'{v:.3f}')} | <= {most:.2f}: "
                       f"{verdict} | {every} |")
    if "ddp" in by:
        for r in rows:
            if r["kind"] != "ddp":
                ratios = [_ratio(x["step_s"], y["step_s"]) for x, y in zip(by[r["kind"]],
                                                                          by["ddp"])]
                out.append(f"| {r['kind']} step time / DDP's | "
                           f"{_spread(ratios, lambda v: f'{v:.3f}')} | - | - |")
    return out


def roofline_clock(rows, spec) -> list[str]:
    """The same logs played with every operator priced by the roofline (no dilation)."""
    us = lambda x: f"{1e6 * x:.1f}"  # noqa: E731
    out = ["The same steps on the roofline's clock (each operator priced on the GPU by "
           "zerolab/roofline.py, as the plan prices it; no dilation; GPU microseconds):", "",
           "| system | step us | compute us | exposed us | overlap |", "|---|---|---|---|---|"]
    for r in rows:
        rounds = r["emulated_roofline"][spec]
        out.append(f"| {r['kind']} | {_spread([x['step_s'] for x in rounds], us)} | "
                   f"{_spread([x['compute_s'] for x in rounds], us)} | "
                   f"{_spread([x['exposed_s'] for x in rounds], us)} | "
                   f"{_spread([x['overlap'] for x in rounds], lambda v: f'{100 * v:.0f}%')} |")
    return out


def ranking(rows, spec) -> str:
    """The systems fastest first, by emulated step time, in each round; whether it held."""
    rounds = len(rows[0]["emulated"][spec])
    orders = [tuple(sorted((r["kind"] for r in rows),
                           key=lambda k: next(x for x in rows if x["kind"] == k)
                           ["emulated"][spec][i]["step_s"])) for i in range(rounds)]
    same = all(o == orders[0] for o in orders)
    text = " < ".join(orders[0])
    if same:
        return f"Ranking by emulated step time, the same in all {rounds} round(s): {text}."
    return ("Ranking by emulated step time differs between rounds: "
            + "; ".join(" < ".join(o) for o in orders) + ".")


def plan_beside(rows, spec, info) -> list[str]:
    """The plan's exposed communication (zerolab/steptime.py on the same model, ranks and
    links) beside the emulated one, both in GPU seconds."""
    d = info["dilation"]
    out = ["The plan's exposed communication for the same model, ranks, batch and links "
           "(python -m zerolab plan: zerolab/steptime.py, its compute by the roofline), beside "
           "the emulated one in GPU microseconds (emulated / dilation):", "",
           "| system | plan exposed us | emulated exposed us | plan / emulated | within 20% | "
           "plan step us | emulated step us |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = info["plan"].get(r["kind"])
        if p is None:
            continue
        if "error" in p:
            out.append(f"| {r['kind']} | plan failed: {p['error']} | | | | | |")
            continue
        rounds = r["emulated"][spec]
        mid = lambda key: sorted(x[key] for x in rounds)[(len(rounds) - 1) // 2] / d  # noqa: E731
        e, s = mid("exposed_s"), mid("step_s")
        ratio = _ratio(p["exposed_comm_s"], e)
        out.append(f"| {r['kind']} | {1e6 * p['exposed_comm_s']:.1f} | {1e6 * e:.1f} | "
                   f"{ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.2 else 'no'} | "
                   f"{1e6 * p['step_s']:.1f} | {1e6 * s:.1f} |")
    return out


def write_trace(rows, args, path: str) -> str:
    """Rank 0's median step of every system's last round, on each network, as a Chrome trace."""
    from zerolab.emulate import chrome_trace

    steps = []
    for spec, info in args.emulation["networks"].items():
        for r in rows:
            log, played = r["emulated"][spec][-1]["trace"]
            steps.append((f"{r['kind']} on {spec}", log, played, info["dilation"]))
    _dump(chrome_trace(steps), path)
    return path


def _dump(trace: dict, path: str) -> None:
    """A trace as JSON, gzipped where the path ends in .gz (Perfetto opens either)."""
    import gzip
    import json

    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        json.dump(trace, f)


def write_targets(sections, args, argv) -> str:
    """One results file for ``--targets``: each configuration's emulated tables, then every
    target's verdict in one table."""
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"{date}-{machine()}-emulated.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    a0 = sections[0][0]
    nets = a0.emulation["networks"]
    head = [f"# Emulated GPU cluster: issue 46's targets, {date}", "",
            f"- machine: {machine()} ({cpu_name()}), device cpu (gloo), each rank on one thread",
            f"- torch {torch.__version__}",
            f"- command: `python {' '.join(argv)}`",
            "- networks: " + "; ".join(f"{spec}: {info['cluster']}"
                                       for spec, info in nets.items()),
            f"- systems interleaved round by round, {args.rounds} rounds; AdamW, fp32; batch "
            f"{args.batch} x seq {args.seq} per rank",
            "- every figure is emulated (zerolab/emulate.py): compute is this CPU's, measured "
            "as the CPU time inside aten operators (--clock kernels); each collective lasts "
            "what zerolab/cost.py prices it at on the preset's links, times the dilation factor "
            "(this CPU's compute for a step / the GPU's by the plan's roofline), and the "
            "streams behave as a GPU's. The roofline clock plays the same logs with every "
            "operator priced on the GPU by the roofline instead (no dilation). Not emulated: "
            "compute slowed by NCCL sharing the SMs and memory bandwidth, and the host's own "
            "time, taken to run ahead of the GPU (notes/10-overlap.md)."]
    summary = ["", "## Every target", "",
               "| model | ranks | network | dilation | target | median [min-max] over rounds "
               "| holds (median) | holds every round | roofline clock | holds |",
               "|---|---|---|---|---|---|---|---|---|---|"]
    plan_rows = ["", "## The plan beside the emulation (exposed communication, GPU us)", "",
                 "The plan: zerolab/steptime.py on the same model, ranks, batch and links, "
                 "without its \"contention\" effect, which the emulation does not have. "
                 "Emulated: the kernels clock's exposed time over the dilation, and the roofline "
                 "clock's (each operator priced as the plan prices it).", "",
                 "| model | ranks | network | system | plan | emulated | plan / emulated "
                 "| within 20% | emulated, roofline clock | plan / it | within 20% |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
    body = []
    for a, rows in sections:
        label = f"GPT {a.layers} x {a.dim}, Ψ = {rows[0]['psi']:,}"
        body += ["", f"# {label}, {a.world_size} ranks", ""]
        body += [loss_check(rows)]
        body += emulated_tables(rows, a)
        for spec, info in a.emulation["networks"].items():
            by = {r["kind"]: r["emulated"][spec] for r in rows}
            for what, x, y, key, most in EMULATED_TARGETS:
                if x in by and y in by:
                    ratios = [_ratio(p[key], q[key]) for p, q in zip(by[x], by[y])]
                    med = sorted(ratios)[(len(ratios) - 1) // 2]
                    roof = {r["kind"]: r.get("emulated_roofline", {}).get(spec) for r in rows}
                    rr = [_ratio(p[key], q[key]) for p, q in zip(roof[x] or [], roof[y] or [])]
                    rmed = sorted(rr)[(len(rr) - 1) // 2] if rr else None
                    summary.append(
                        f"| {label} | {a.world_size} | {spec} | {info['dilation']:.1f} | {what} "
                        f"<= {most:.2f} | {_spread(ratios, lambda v: f'{v:.3f}')} | "
                        f"{'yes' if med <= most else 'no'} | "
                        f"{'yes' if all(v <= most for v in ratios) else 'no'} | "
                        + (f"{_spread(rr, lambda v: f'{v:.3f}')} | "
                           f"{'yes' if rmed <= most else 'no'} |" if rr else "- | - |"))
            for r in rows:
                p = info.get("plan", {}).get(r["kind"])
                if not p or "error" in p:
                    continue
                rounds = r["emulated"][spec]
                e = sorted(x["exposed_s"] for x in rounds)[(len(rounds) - 1) // 2] \
                    / info["dilation"]
                ratio = _ratio(p["exposed_comm_s"], e)
                cells = "- | - | - |"
                if r.get("emulated_roofline"):
                    rr = r["emulated_roofline"][spec]
                    g = sorted(x["exposed_s"] for x in rr)[(len(rr) - 1) // 2]
                    gr = _ratio(p["exposed_comm_s"], g)
                    cells = f"{1e6 * g:.1f} | {gr:.2f} | {'yes' if abs(gr - 1) <= 0.2 else 'no'} |"
                plan_rows.append(f"| {label} | {a.world_size} | {spec} | {r['kind']} | "
                                 f"{1e6 * p['exposed_comm_s']:.1f} | {1e6 * e:.1f} | {ratio:.2f} "
                                 f"| {'yes' if abs(ratio - 1) <= 0.2 else 'no'} | {cells}")
    trace = out.removesuffix(".md") + ".trace.json.gz"
    steps = []
    from zerolab.emulate import chrome_trace

    for a, rows in sections:
        for spec, info in a.emulation["networks"].items():
            for r in rows:
                log, played = r["emulated"][spec][-1]["trace"]
                steps.append((f"{r['kind']}, {a.layers}x{a.dim}, {a.world_size} ranks, {spec}",
                              log, played, info["dilation"]))
    _dump(chrome_trace(steps), trace)
    tail = ["", f"Emulated timelines (rank 0's median step of each system's last round, GPU "
                f"microseconds; open in https://ui.perfetto.dev): `{os.path.basename(trace)}`"]
    text = "\n".join(head + summary + plan_rows + body + tail) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out} and {trace}")
    return out
