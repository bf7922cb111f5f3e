"""ZeRO-3 measured: a step's collectives on a timeline, storage freed after forward, prefetch,
memory, mixed precision and activation checkpointing.

    python notes/figures/stage3.py > notes/figures/stage3.txt   # also writes stage3_ledger_timeline.png

All on 2 gloo ranks, rank 0's view, AdamW, one step after a warm-up step.
Part 1: the ledger of one step of a GPT with 4 blocks (dim 32): each collective from the
moment it was issued (Record.time) to the moment rank 0's wait() for it returned
(Record.done), beside each unit's forward and backward (zerolab.trace watches the hooks); the
PNG draws it. Part 2: each unit's unsharded storage right after its forward, and the most
units unsharded at once. Part 3: tests/core/test_memory.py's model (8 blocks of dim 64):
model-state bytes against the paper's 16Ψ/N and zerolab.memory.schedule. Part 4: bf16
parameters / fp32 reduction: the ledger's dtypes, and FSDP2 side by side for 3 steps.
Part 5: collectives per unit with activation checkpointing and with a unit called twice.
The times in Part 1 change from run to run; nothing else does.
"""

import os
import warnings

import torch
from torch.distributed._tools.mem_tracker import _MemRefType as Ref
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import zero
from zerolab.memory import model_state_bytes, schedule
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System
from zerolab.trace import trace
from zerolab.trackers import MODEL_STATES, ZeroMemTracker

WORLD_SIZE = 2
TIMELINE = GPTConfig(layers=4)  # dim 32, vocab 96, seq 16
MEMORY = GPTConfig(layers=8, dim=64, vocab=64, seq=16)  # tests/core/test_memory.py's model
PNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stage3_ledger_timeline.png")
warnings.filterwarnings("ignore")


def build(config, stage=3, mp=None, model=None):
    torch.manual_seed(0)
    model = model or GPT(config)
    for unit in model.units():
        zero.shard(unit, stage=stage, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(model, rank, i):
    return model.batch(4, torch.Generator().manual_seed(10 * i + rank))


def step(model, opt, rank, i):
    x, y = batch(model, rank, i)
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# ---- Part 1: the timeline ---------------------------------------------------------------------

def spans(t):
    """From a zerolab.trace.Trace: per unit, its compute spans and its collectives' spans (ms),
    and the phases of the step."""
    compute, started, marks = {}, {}, {}
    for e in t.events:
        if e.record is not None:
            continue
        if not e.unit:
            marks[e.what.split(":")[0]] = 1e3 * e.time
        elif e.what.startswith(("pre_forward", "pre_backward")):
            started[e.unit] = (e.what.split("_")[1], 1e3 * e.time)
        elif e.what.startswith(("post_forward", "post_backward")) and e.unit in started:
            kind, begin = started.pop(e.unit)
            compute.setdefault(e.unit, []).append((kind, begin, 1e3 * e.time))
    done = {id(e.record): 1e3 * e.time for e in t.events if e.done}
    issued = {id(e.record): 1e3 * e.time for e in t.events if e.record is not None and not e.done}
    collectives = [(r.op, r.unit, r.phase, str(r.dtype), r.buffer_bytes, r.sent_bytes,
                    issued[id(r)], done.get(id(r))) for r in t.records]
    return compute, collectives, marks


def draw(compute, collectives, marks, units):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {("all_gather", "forward"): "#4c72b0", ("all_gather", "backward"): "#8172b3",
               ("reduce_scatter", "backward"): "#c44e52", ("all_reduce", "backward"): "#937860"}
    labels = {("all_gather", "forward"): "all-gather (forward)",
              ("all_gather", "backward"): "all-gather (backward)",
              ("reduce_scatter", "backward"): "reduce-scatter",
              ("all_reduce", "backward"): "all-reduce of the used-flags"}
    shades = {"forward": "#c9d6ea", "backward": "#f3d9c7"}
    rows = list(reversed(units))  # the root on top, in forward order downwards
    fig, ax = plt.subplots(figsize=(12.5, 3.9))
    phases = [("forward", "backward"), ("backward", "opt.step()"), ("opt.step()", "opt.zero_grad()")]
    for start, end in phases:
        ax.axvline(marks[start], color="#888888", linewidth=0.6, linestyle=":")
        ax.text((marks[start] + marks[end]) / 2, len(rows) - 0.45, start, ha="center",
                va="bottom", fontsize=8, color="#555555")
    seen = set()
    for unit, spans_ in compute.items():
        for kind, begin, end in spans_:
            ax.barh(rows.index(unit) + 0.17, end - begin, left=begin, height=0.3,
                    color=shades[kind], edgecolor="#999999", linewidth=0.4,
                    label=f"{kind} (pre_ to post_ hook)" if kind not in seen else None)
            seen.add(kind)
    for op, unit, phase, _, _, _, issued, done in collectives:
        key = (op, phase)
        if key not in colours or done is None:
            continue
        ax.barh(rows.index(unit) - 0.17, max(done - issued, 0.1), left=issued, height=0.3,
                color=colours[key], edgecolor="black", linewidth=0.4,
                label=labels[key] if key not in seen else None)
        seen.add(key)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.6, len(rows) - 0.05)
    ax.set_xlim(marks["forward"] - 0.5, marks["opt.zero_grad()"] + 0.5)
    ax.set_xlabel("ms since forward began (rank 0); a collective's bar runs from its issue to the "
                  "return of its wait()", fontsize=9)
    ax.set_title("One ZeRO-3 step, GPT with 4 blocks (dim 32), N = 2: each unit's compute (light) "
                 "and collectives (dark)", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), framealpha=0.9)
    fig.tight_layout()
    fig.savefig(PNG, dpi=120)


# ---- Part 2: storage after forward, units unsharded at once -------------------------------------

class Unsharded(TorchDispatchMode):
    def __init__(self, units):
        super().__init__()
        self.units = units
        self.resharding = [u for u in units if u.reshard_after_forward]
        self.most, self.peak, self.who = 0, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = [u.name for u in self.resharding if u.unsharded.untyped_storage().nbytes()]
        if len(live) > self.most:
            self.most, self.who = len(live), live
        self.peak = max(self.peak, sum(u.unsharded.untyped_storage().nbytes() for u in self.units))
        return out


def storage(rank, n):
    model, opt = build(TIMELINE)
    step(model, opt, rank, 0)
    units = zero.units_of(model)
    after = []
    for u in units:  # registered after zero's post-forward hook: sees the state it leaves
        u.modules[0].register_forward_hook(
            lambda m, a, o, u=u: after.append((u.name, u.unsharded.untyped_storage().nbytes(),
                                               4 * u.layout.padded_numel, u.reshard_after_forward)))
    probe = Unsharded(units)
    with probe:
        step(model, opt, rank, 1)
    return after, probe.most, probe.who, probe.peak, {u.name: 4 * u.layout.padded_numel for u in units}


# ---- Part 3: memory ---------------------------------------------------------------------------

def memory(rank, n):
    model, opt = build(MEMORY)
    step(model, opt, rank, 0)
    units = zero.units_of(model)
    with ZeroMemTracker(model, opt) as mt:
        step(model, opt, rank, 1)
    peaks = mt.category_peaks[torch.device("cpu")]
    predicted = schedule([u.layout.padded_numel for u in units], 3, n,
                         sum(len(u.params) for u in units))
    return {"psi": sum(u.layout.numel for u in units),
            "unit": 4 * max(u.layout.padded_numel for u in units),
            "root": 4 * units[0].layout.padded_numel,
            "states": peaks[MODEL_STATES], "kept": mt.model_states_peak,
            "transient": mt.transient_peak,
            "kept_param": mt.state_peaks[Ref.PARAM], "kept_grad": mt.state_peaks[Ref.GRAD],
            "kept_opt": mt.state_peaks[Ref.OPT], "schedule": predicted}


# ---- Part 4: mixed precision ---------------------------------------------------------------------

def mixed_precision(rank, n):
    torch.manual_seed(0)
    base = GPT()
    systems = [System(k, base, "adamw", mp=True) for k in ("fsdp2", "zero3")]
    equal = []
    for i in range(3):
        with zero.Ledger() as ledger:
            losses = [s.step(rank, i)[0] for s in systems]
        ref, ours = (s.full_params() for s in systems)
        equal.append((torch.equal(losses[0], losses[1]), all(torch.equal(ref[k], ours[k]) for k in ref)))
    kinds = sorted({(r.op, r.phase, str(r.dtype)) for r in ledger.records})
    by_kind = {k: sum(r.buffer_bytes for r in ledger.records if (r.op, r.phase, str(r.dtype)) == k)
               for k in kinds}
    units = zero.units_of(systems[1].model)
    return equal, by_kind, sum(u.layout.padded_numel for u in units), units[0].layout.padded_numel


# ---- Part 5: activation checkpointing, a unit called twice -------------------------------------

class Variant(GPT):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if self.mode == "ac_outside":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.mode == "twice" and i == 0:
                x = block(block(x))
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def per_unit(rank, n, mode):
    torch.manual_seed(0)
    model, opt = build(None, model=Variant(mode))
    if mode == "ac_inside":  # checkpoint inside each block's forward (the recompute skips the hooks)
        for block in model.blocks:
            block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    step(model, opt, rank, 0)
    with zero.Ledger() as ledger:
        step(model, opt, rank, 1)
    out = {}
    for r in ledger.records:
        if r.op in ("all_gather", "reduce_scatter"):
            key = {("all_gather", "forward"): 0, ("all_gather", "backward"): 1,
                   ("reduce_scatter", "backward"): 2}[(r.op, r.phase)]
            out.setdefault(r.unit, [0, 0, 0])[key] += 1
    return out


def main():
    t = trace(3, layers=TIMELINE.layers, dim=TIMELINE.dim, world_size=WORLD_SIZE)
    compute, collectives, marks = spans(t)
    units = [name for name, _ in t.units]
    print(f"N = {WORLD_SIZE} gloo ranks, stage 3, rank 0\n")
    print(f"Part 1: one step of GPT {TIMELINE} (Ψ = {t.psi}), each collective from its issue to "
          f"the return of its wait()\n")
    print("  phases (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in marks.items()))
    print(f"\n  {'issued':>7} {'done':>7}  {'op':<15} {'unit':<9} {'phase':<9} {'dtype':<14} "
          f"{'buffer':>7} {'sent':>6}")
    for op, unit, phase, dtype, buf, sent, issued, done in collectives:
        print(f"  {issued:7.2f} {done:7.2f}  {op:<15} {unit:<9} {phase:<9} {dtype:<14} {buf:>7} "
              f"{sent:>6}")
    big = sum(c[5] for c in collectives if c[0] in ("all_gather", "reduce_scatter"))
    print(f"\n  all-gathers + reduce-scatters: {big} bytes = "
          f"{big / (4 * t.psi * (WORLD_SIZE - 1) / WORLD_SIZE):.3f} R")
    draw(compute, collectives, marks, units)
    print(f"  drawn: notes/figures/{os.path.basename(PNG)}")

    after, most, who, peak, sizes = run_ranks(storage, WORLD_SIZE)[0]
    print("\nPart 2: each unit's unsharded storage right after its forward (same model)\n")
    for name, nbytes, full, reshards in after:
        print(f"  {name:<9} {nbytes:>6} bytes of {full:>6}  (reshard_after_forward {reshards})")
    kept = sum(sizes[n] for n, _, _, r in after if not r)
    two = sorted((s for n, s in sizes.items() if n != "root"))[-2:]
    print(f"\n  the most resharding units unsharded at once: {most} ({who})")
    print(f"  peak of all unsharded storage: {peak} bytes = the root's {kept} + two blocks' "
          f"{sum(two)} = {kept + sum(two)}")

    m = run_ranks(memory, WORLD_SIZE)[0]
    psi, n = m["psi"], WORLD_SIZE
    formula = model_state_bytes(psi, n, stage=3, mixed_precision=False)
    print(f"\nPart 3: model states, tests/core/test_memory.py's model (Ψ = {psi}), fp32\n")
    print(f"  paper (4 + 4 + 8) Ψ / N = {formula:.0f} bytes = {formula / psi:.3f} bytes/Ψ")
    print(f"  measured, without transients (ZeroMemTracker.model_states_peak): {m['kept']} = "
          f"{m['kept'] / psi:.3f} bytes/Ψ (params {m['kept_param']}, grads {m['kept_grad']}, "
          f"optimizer {m['kept_opt']})")
    print(f"  measured, at the worst instant: {m['states']} = {m['states'] / psi:.3f} bytes/Ψ; "
          f"transient peak {m['transient']}")
    sch = m["schedule"]
    print(f"  zerolab.memory.schedule, unit by unit: at rest {sch['at_rest']} + in flight "
          f"{sch['in_flight']} = {sch['peak']} (measured: {m['states']})")
    print(f"  one block's full parameters or full gradient = {m['unit']} bytes; the root's "
          f"parameters {m['root']}")
    stage2 = model_state_bytes(psi, n, stage=2, mixed_precision=False)
    print(f"  for comparison, the paper's stage 2: {stage2:.0f} = {stage2 / psi:.3f} bytes/Ψ")

    equal, by_kind, padded, root = run_ranks(mixed_precision, WORLD_SIZE)[0]
    print(f"\nPart 4: bf16 parameters, fp32 reduction (small GPT, padded Ψ {padded}, root {root})\n")
    for (op, phase, dtype), nbytes in by_kind.items():
        print(f"  {op:<15} {phase:<9} {dtype:<15} {nbytes:>7} bytes of buffers "
              f"= {nbytes / padded:.3f} bytes per element")
    print(f"  zero3 vs fsdp2, steps 0..2: (loss bitwise equal, parameters bitwise equal) = {equal}")

    print("\nPart 5: collectives per unit in one step: all-gathers in forward / in backward / "
          "reduce-scatters (small GPT, 2 blocks)\n")
    for mode in ("plain", "ac_inside", "ac_outside", "twice"):
        out = run_ranks(per_unit, WORLD_SIZE, mode)[0]
        print(f"  {mode:<11} " + ", ".join(f"{u} {a}/{b}/{c}" for u, (a, b, c) in out.items()))


if __name__ == "__main__":
    main()
