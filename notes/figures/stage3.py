"""ZeRO-3 measured: a step's collectives on a timeline, storage freed after forward, prefetch,
memory, mixed precision and activation checkpointing.

    python notes/figures/stage3.py > notes/figures/stage3.txt   # also writes stage3_ledger_timeline.png

All on 2 gloo ranks, rank 0's view, AdamW, one step after a warm-up step.
Part 1: the ledger of one step of a GPT with 4 blocks (dim 32), with each record's issue time
(Record.time); the PNG draws it. Part 2: each unit's unsharded storage right after its forward,
and the most units unsharded at once. Part 3: tests/test_memory.py's model (8 blocks of dim 64):
model-state bytes against the paper's 16Ψ/N. Part 4: bf16 parameters / fp32 reduction: the
ledger's dtypes, and FSDP2 side by side for 3 steps. Part 5: collectives per unit with
activation checkpointing and with a unit called twice.
"""

import os
import warnings

import torch
from torch.distributed._tools.mem_tracker import _MemRefType as Ref
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import zero
from zerolab.launch import run_ranks
from zero.memory import model_state_bytes
from zerolab.trackers import MODEL_STATES, ZeroMemTracker
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

WORLD_SIZE = 2
TIMELINE = GPTConfig(layers=4)  # dim 32, vocab 96, seq 16
MEMORY = GPTConfig(layers=8, dim=64, vocab=64, seq=16)  # tests/test_memory.py's model
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

def timeline(rank, n):
    import time

    model, opt = build(TIMELINE)
    step(model, opt, rank, 0)
    marks = {}
    x, y = batch(model, rank, 1)
    with zero.Ledger() as ledger:
        marks["forward"] = time.perf_counter()
        loss = model.loss(model(x), y)
        marks["backward"] = time.perf_counter()
        loss.backward()
        marks["optimizer step"] = time.perf_counter()
        opt.step()
        marks["end"] = time.perf_counter()
    opt.zero_grad()
    t0 = marks["forward"]
    records = [(r.op, r.unit, r.phase, str(r.dtype), r.buffer_bytes, r.sent_bytes,
                1e3 * (r.time - t0)) for r in ledger.records]
    units = [u.name for u in zero.units_of(model)]
    psi = sum(u.layout.numel for u in zero.units_of(model))
    return records, {k: 1e3 * (v - t0) for k, v in marks.items()}, units, psi


def draw(records, marks, units):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {("all_gather", "forward"): "#4c72b0", ("all_gather", "backward"): "#8172b3",
               ("reduce_scatter", "backward"): "#c44e52", ("all_reduce", "backward"): "#937860"}
    labels = {("all_gather", "forward"): "all-gather (forward)",
              ("all_gather", "backward"): "all-gather (backward)",
              ("reduce_scatter", "backward"): "reduce-scatter (backward)",
              ("all_reduce", "backward"): "all-reduce of the used-flags"}
    rows = list(reversed(units))  # the root on top, in forward order downwards
    fig, ax = plt.subplots(figsize=(11, 3.6))
    spans = [("forward", "backward", "#e8eef7"), ("backward", "optimizer step", "#f7ece6"),
             ("optimizer step", "end", "#e9f3ea")]
    for start, end, colour in spans:
        ax.axvspan(marks[start], marks[end], color=colour, zorder=0)
        ax.text((marks[start] + marks[end]) / 2, len(rows) - 0.35, start, ha="center",
                va="bottom", fontsize=8, color="#555555")
    seen = set()
    for op, unit, phase, _, _, _, t in records:
        key = (op, phase)
        y = rows.index(unit) + {"forward": 0.15, "backward": -0.15}[phase] * (op == "all_gather")
        ax.scatter([t], [y], s=70, marker="v" if op == "reduce_scatter" else "o",
                   color=colours[key], edgecolor="black", linewidth=0.5, zorder=3,
                   label=labels[key] if key not in seen else None)
        seen.add(key)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.7, len(rows) - 0.1)
    ax.set_xlim(marks["forward"] - 1, marks["end"] + 1)
    ax.set_xlabel("ms since forward began (rank 0); a marker is the moment the collective was issued")
    ax.set_title("One ZeRO-3 step, GPT with 4 blocks (dim 32), N = 2: zero.Ledger records by issue time",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
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
        live = [u.name for u in self.resharding if u._unsharded_data.untyped_storage().nbytes()]
        if len(live) > self.most:
            self.most, self.who = len(live), live
        self.peak = max(self.peak, sum(u._unsharded_data.untyped_storage().nbytes() for u in self.units))
        return out


def storage(rank, n):
    model, opt = build(TIMELINE)
    step(model, opt, rank, 0)
    units = zero.units_of(model)
    after = []
    for u in units:  # registered after zero's post-forward hook: sees the state it leaves
        u.module.register_forward_hook(
            lambda m, a, o, u=u: after.append((u.name, u._unsharded_data.untyped_storage().nbytes(),
                                               4 * u.layout.padded_numel, u.reshard_after_forward)))
    probe = Unsharded(units)
    with probe:
        step(model, opt, rank, 1)
    return after, probe.most, probe.who, probe.peak, {u.name: 4 * u.layout.padded_numel for u in units}


# ---- Part 3: memory ---------------------------------------------------------------------------

class Transient(TorchDispatchMode):
    """After every op: the bytes of unsharded parameters, full flat gradients and gradient
    shards, and at their largest, whose they are."""

    def __init__(self, units):
        super().__init__()
        self.units, self.peak, self.at_peak = units, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        params = [u for u in self.units if u._unsharded_data.untyped_storage().nbytes()]
        full = [u for u in self.units if u.unsharded.grad is not None or u._reduction is not None]
        shards = [u for u in self.units if u._grad_shard is not None or u._reduction is not None]
        now = (sum(u._unsharded_data.untyped_storage().nbytes() for u in params)
               + sum(4 * u.layout.padded_numel for u in full)
               + sum(4 * u.layout.shard_numel for u in shards))
        if now > self.peak:
            self.peak = now
            self.at_peak = ([u.name for u in params], [u.name for u in full],
                            [u.name for u in self.units if u._reduction is not None], len(shards),
                            sum(4 * u.layout.shard_numel for u in shards))
        return out


def memory(rank, n):
    model, opt = build(MEMORY)
    step(model, opt, rank, 0)
    units = zero.units_of(model)
    probe = Transient(units)
    with ZeroMemTracker(model, opt) as mt:
        with probe:
            x, y = batch(model, rank, 1)
            model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    peaks = mt.category_peaks[torch.device("cpu")]
    return {"psi": sum(u.layout.numel for u in units),
            "unit": 4 * max(u.layout.padded_numel for u in units),
            "root": 4 * units[0].layout.padded_numel,
            "states": peaks[MODEL_STATES], "kept": mt.model_states_peak,
            "transient": mt.transient_peak,
            "param": peaks[Ref.PARAM], "grad": peaks[Ref.GRAD],
            "kept_param": mt.state_peaks[Ref.PARAM], "kept_grad": mt.state_peaks[Ref.GRAD],
            "kept_opt": mt.state_peaks[Ref.OPT], "probe": probe.peak, "at_peak": probe.at_peak,
            "sharded": sum(4 * u.layout.shard_numel for u in units)}


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
        if r.op != "all_reduce":
            key = {("all_gather", "forward"): 0, ("all_gather", "backward"): 1,
                   ("reduce_scatter", "backward"): 2}[(r.op, r.phase)]
            out.setdefault(r.unit, [0, 0, 0])[key] += 1
    return out


def main():
    records, marks, units, psi = run_ranks(timeline, WORLD_SIZE)[0]
    print(f"N = {WORLD_SIZE} gloo ranks, stage 3, rank 0\n")
    print(f"Part 1: one step of GPT {TIMELINE} (Ψ = {psi}), ledger records by issue time\n")
    print("  phases (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in marks.items()))
    print(f"\n  {'ms':>7}  {'op':<15} {'unit':<9} {'phase':<9} {'dtype':<14} {'buffer':>7} {'sent':>6}")
    for op, unit, phase, dtype, buf, sent, t in records:
        print(f"  {t:7.2f}  {op:<15} {unit:<9} {phase:<9} {dtype:<14} {buf:>7} {sent:>6}")
    big = sum(r[5] for r in records if r[0] != "all_reduce")
    print(f"\n  all-gathers + reduce-scatters: {big} bytes = "
          f"{big / (4 * psi * (WORLD_SIZE - 1) / WORLD_SIZE):.3f} Ψ")
    draw(records, marks, units)
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
    print(f"\nPart 3: model states, tests/test_memory.py's model (Ψ = {psi}), fp32\n")
    print(f"  paper (4 + 4 + 8) Ψ / N = {formula:.0f} bytes = {formula / psi:.3f} bytes/Ψ")
    print(f"  measured, less transients (ZeroMemTracker.model_states_peak): {m['kept']} = "
          f"{m['kept'] / psi:.3f} bytes/Ψ (params {m['kept_param']}, grads {m['kept_grad']}, "
          f"optimizer {m['kept_opt']})")
    print(f"  measured, at the worst instant: {m['states']} = {m['states'] / psi:.3f} bytes/Ψ; "
          f"transient peak {m['transient']}")
    params, full, flight, shards, shard_bytes = m["at_peak"]
    print(f"  the worst instant, by a probe after every op: unsharded parameters of {params},")
    print(f"    full flat gradients of {full} (reduce-scatter in flight: {flight}), gradient "
          f"shards of {shards} units ({shard_bytes} bytes)")
    print(f"    one block's full parameters or full gradient = {m['unit']} bytes; the root's "
          f"parameters {m['root']}")
    print(f"    probe {m['probe']} + fp32 shards {m['sharded']} + optimizer state {m['kept_opt']} = "
          f"{m['probe'] + m['sharded'] + m['kept_opt']}")
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
