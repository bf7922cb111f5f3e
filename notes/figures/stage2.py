"""ZeRO-2 measured: one hook per unit per backward, the gradient peak, frozen and unused
parameters, no_sync.

    python notes/figures/stage2.py > notes/figures/stage2.txt

All on 2 gloo ranks, rank 0's view, AdamW.
Part 1: how often a unit's forward runs and how often the post-accumulate-grad hook on its
flat leaf fires per backward, for a plain GPT, a GPT whose first block is called twice, and
activation checkpointing inside / around each block (tests/features/test_features.py's variants).
Part 2: tests/core/test_memory.py's model (8 blocks of dim 64): the gradients' peak and the
model states' (ZeroMemTracker), beside tests/core/test_memory.py's bound and zerolab.memory.schedule.
Part 3: a module with a frozen layer in front of a trainable one (sharded as two units, its
trainable and its frozen parameters): the order of events in backward. Part 4: UnevenMLP (a frozen and an unused layer): which parameters get a gradient,
and the one all-reduce that agrees on it. Part 5: two micro-batches, the first under no_sync.
Part 6: reentrant activation checkpointing: every parameter gets its gradient at every stage
(an earlier version left 24 of 28 without one at stages 1 and 2).
"""

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import _MemRefType as Ref
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import zero
from zerolab.launch import run_ranks
from zerolab.memory import model_state_bytes, schedule
from zerolab.trackers import MODEL_STATES, ZeroMemTracker
from zerolab.models import GPT, GPTConfig, UnevenMLP

WORLD_SIZE = 2


def batch_step(model, rank, i, opt=None):
    x, y = model.batch(2, torch.Generator().manual_seed(10 * i + rank))
    model.loss(model(x), y).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


# ---- Part 1: the hook fires once per backward ----------------------------------------------

class Variant(GPT):
    """mode: "plain", "twice" (blocks.0 called twice), "ac_inside" / "ac_outside"
    (non-reentrant activation checkpointing inside each block's forward / around it)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if self.mode == "ac_outside":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.mode == "ac_inside":
                x = block(x)  # the block's own forward is checkpointed, see below
            else:
                x = block(block(x)) if (self.mode == "twice" and i == 0) else block(x)
        return self.head(self.ln_f(x))


def hook_counts(rank, n, mode):
    torch.manual_seed(0)
    model = Variant(mode)
    if mode == "ac_inside":
        for block in model.blocks:
            block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    for unit in model.units():
        zero.shard(unit, stage=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch_step(model, rank, 0, opt)
    calls, fired = {}, {}

    def count(table, name):
        table[name] = table.get(name, 0) + 1

    for u in zero.units_of(model):
        u.modules[0].register_forward_pre_hook(lambda m, a, u=u: count(calls, u.name))
        u.unsharded.register_post_accumulate_grad_hook(lambda leaf, u=u: count(fired, u.name))
    with zero.Ledger() as ledger:
        batch_step(model, rank, 1, opt)
    reduced = {}
    for r in ledger.select(op="reduce_scatter"):
        reduced[r.unit] = reduced.get(r.unit, 0) + 1
    return {u.name: (calls.get(u.name, 0), fired.get(u.name, 0), reduced.get(u.name, 0))
            for u in zero.units_of(model)}


# ---- Part 2: the gradient peak -----------------------------------------------------------

def gradient_peak(rank, n, stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, dim=64, vocab=64, seq=16))  # tests/core/test_memory.py's model
    for unit in model.units():
        zero.shard(unit, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch_step(model, rank, 0, opt)
    units = zero.units_of(model)
    with ZeroMemTracker(model, opt) as mt:
        batch_step(model, rank, 1, opt)
    peaks = mt.category_peaks[torch.device("cpu")]
    return {"tracker": peaks[Ref.GRAD], "states": peaks[MODEL_STATES], "kept": mt.model_states_peak,
            "schedule": schedule([u.layout.padded_numel for u in units], stage, n,
                                 sum(len(u.params) for u in units)),
            "psi": sum(u.layout.numel for u in units),
            "unit": 4 * max(u.layout.padded_numel for u in units),
            "root": 4 * units[0].layout.padded_numel}


# ---- Part 3: a frozen layer in front of a trainable one ---------------------------------------

class FrozenFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.trained = nn.Linear(8, 8)

    def forward(self, x):
        z = self.frozen(x)
        if z.grad_fn is not None:  # runs when backward reaches the frozen layer: it reads frozen.weight
            z.grad_fn.register_hook(lambda gin, gout: note(
                "the frozen layer's backward reads frozen.weight"))
        return self.trained(z)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.unit = FrozenFirst()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.unit(self.inp(x)))


events, watched = [], []


def note(what):
    """An event, and the full-parameter bytes of the unit's trainable and frozen parts."""
    sizes = ", ".join(f"{name} {u.unsharded.untyped_storage().nbytes()} B" for name, u in watched)
    events.append(f"{what:<48} full: {sizes}")


def frozen_order(rank, n, stage):
    torch.manual_seed(0)
    model = Outer()
    zero.shard(model.unit, stage=stage)  # two units: its trainable and its frozen parameters
    zero.shard(model, stage=stage)
    units = zero.units_of(model.unit)
    watched[:] = [("trained", next(u for u in units if u.sibling_of is None)),
                  ("frozen", next(u for u in units if u.sibling_of is not None))]
    watched[0][1].unsharded.register_post_accumulate_grad_hook(
        lambda leaf: note("trainable gradient complete; post_backward next"))
    def hook_input(module, args):
        args[0].register_hook(lambda grad: note("the gradient of the unit's input exists"))

    model.unit.register_forward_pre_hook(hook_input)
    events.clear()
    model(torch.randn(4, 8)).sum().backward()
    note("backward returns")
    return list(events)


class UnshardedBlocks(TorchDispatchMode):
    """After every op: how many blocks hold full parameters at once (a block whose frozen
    parameters are a unit of their own counts once, whichever of its units is unsharded)."""

    def __init__(self, units):
        super().__init__()
        self.units, self.most = [u for u in units if u.reshard_after_forward], 0
        self.blocks = {u.modules[0] for u in self.units}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = {u.modules[0] for u in self.units if u.unsharded.untyped_storage().nbytes()}
        self.most = max(self.most, len(live))
        return out


def frozen_cost(rank, n, freeze):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6))
    if freeze:
        for block in model.blocks:
            block.ln1.requires_grad_(False)  # one small frozen tensor in every block
    for unit in model.units():
        zero.shard(unit, stage=3)
    batch_step(model, rank, 0)
    probe = UnshardedBlocks(zero.units_of(model))
    with probe:
        batch_step(model, rank, 1)
    return probe.most, len(probe.blocks), len(probe.units)


# ---- Part 4: frozen and unused parameters -----------------------------------------------------

def frozen_and_unused(rank, n):
    torch.manual_seed(0)
    model = UnevenMLP()
    for unit in model.units():
        zero.shard(unit, stage=2)
    with zero.Ledger() as ledger:
        batch_step(model, rank, 0)
    grads = {name: None if p.grad is None else tuple(p.grad.shape) for name, p in model.named_parameters()}
    flags = [(r.op, str(r.dtype), r.buffer_bytes) for r in ledger.select(op="all_reduce")]
    return grads, flags, len(list(model.parameters()))


# ---- Part 5: no_sync --------------------------------------------------------------------------

def accumulate(rank, n):
    torch.manual_seed(0)
    model = GPT()
    for unit in model.units():
        zero.shard(unit, stage=2)
    units = zero.units_of(model)
    out = []
    for micro in range(2):
        with zero.Ledger() as ledger:
            if micro == 0:
                with zero.no_sync(model):
                    batch_step(model, rank, micro)
            else:
                batch_step(model, rank, micro)
        full = sum(u.unsharded.grad.numel() * 4 for u in units if u.unsharded.grad is not None)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out.append((micro, ledger.count(op="reduce_scatter"), ledger.count(), full, len(grads),
                    sum(g.abs().sum().item() for g in grads)))
    return out, sum(u.layout.padded_numel for u in units)


# ---- Part 6: reentrant checkpointing ---------------------------------------------------------

class Reentrant(GPT):
    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(self.ln_f(x))


def reentrant(rank, n, stage):
    torch.manual_seed(0)
    model = Reentrant()
    for unit in model.units():
        zero.shard(unit, stage=stage)
    batch_step(model, rank, 0)
    named = list(model.named_parameters())
    missing = [name for name, p in named if p.grad is None]
    return len(missing), len(named), sorted({name.split(".")[0] + "." + name.split(".")[1]
                                               for name in missing if name.startswith("blocks")})


def main():
    print(f"N = {WORLD_SIZE} gloo ranks, stage 2, rank 0\n")
    print("Part 1: per unit and backward: forward calls, hook firings, reduce-scatters "
          "(small GPT, 2 blocks)\n")
    for mode in ("plain", "twice", "ac_inside", "ac_outside"):
        counts = run_ranks(hook_counts, WORLD_SIZE, mode)[0]
        cells = ", ".join(f"{k} {c}/{f}/{r}" for k, (c, f, r) in counts.items())
        print(f"  {mode:<11} {cells}")

    print("\nPart 2: gradient bytes, tests/core/test_memory.py's model (8 blocks of dim 64), fp32\n")
    for stage in (1, 2):
        g = run_ranks(gradient_peak, WORLD_SIZE, stage)[0]
        full, unit, n = 4 * g["psi"], g["unit"], WORLD_SIZE
        print(f"stage {stage}: peak gradient bytes (ZeroMemTracker) {g['tracker']}")
        print(f"  full gradient 4Ψ = {full}; full/N = {full // n}; one block's full gradient = "
              f"{unit}; the root's {g['root']}")
        if stage == 2:
            bound = full / n + unit + unit / n + g["root"]
            print(f"  tests/core/test_memory.py's bound full/N + one block + its shard + the root's "
                  f"full gradient = {bound:.0f}: measured / bound = {g['tracker'] / bound:.3f}")
        paper = model_state_bytes(g["psi"], n, stage=stage, mixed_precision=False)
        sch = g["schedule"]
        print(f"  model states: without transients {g['kept']} = {g['kept'] / g['psi']:.3f} bytes/Ψ, "
              f"at the worst instant {g['states']} = {g['states'] / g['psi']:.3f} bytes/Ψ; "
              f"paper {paper:.0f} = {paper / g['psi']:.3f} bytes/Ψ")
        print(f"  zerolab.memory.schedule, unit by unit: at rest {sch['at_rest']} + in flight "
              f"{sch['in_flight']} = {sch['peak']}\n")

    print("Part 3: a module whose frozen layer runs before its trainable one (x -> inp -> "
          "[frozen -> trained] -> head); order of events in backward\n")
    for stage in (2, 3):
        print(f"  stage {stage}:")
        for e in run_ranks(frozen_order, WORLD_SIZE, stage)[0]:
            print(f"    {e}")

    print("\n  the cost, stage 3, a GPT of 6 blocks: the most blocks unsharded at once in a step")
    for freeze in (False, True):
        most, blocks, units = run_ranks(frozen_cost, WORLD_SIZE, freeze)[0]
        what = "every block's ln1 frozen" if freeze else "nothing frozen"
        print(f"    {what:<26} {most} of {blocks} (the blocks are {units} units)")

    print("\nPart 4: UnevenMLP at stage 2 (frozen: requires_grad False; unused: never called)\n")
    grads, flags, count = run_ranks(frozen_and_unused, WORLD_SIZE)[0]
    for name, shape in grads.items():
        print(f"  {name:<18} grad {shape}")
    print(f"  all-reduces in the step: {flags} (one uint8 per parameter tensor: {count})")

    print("\nPart 5: two micro-batches of the small GPT at stage 2, the first under zero.no_sync\n")
    rows, padded = run_ranks(accumulate, WORLD_SIZE)[0]
    print(f"  (all units' padded numel: {padded}, i.e. {4 * padded} bytes of fp32 gradient)")
    print(f"  {'micro':>5} {'reduce-scatters':>16} {'collectives':>12} {'full flat grads kept':>21} "
          f"{'params with .grad':>18} {'sum of |.grad|':>15}")
    for micro, rs, total, full, with_grad, size in rows:
        print(f"  {micro:>5} {rs:>16} {total:>12} {full:>21} {with_grad:>18} {size:>15.4g}")

    print("\nPart 6: checkpoint(block, x, use_reentrant=True), small GPT: parameters left with "
          "no gradient after one backward")
    for stage in (1, 2, 3):
        missing, total, blocks = run_ranks(reentrant, WORLD_SIZE, stage)[0]
        print(f"  stage {stage}: {missing} of {total} ({blocks})")


if __name__ == "__main__":
    main()
