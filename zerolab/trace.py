"""One training step, narrated: ``python -m zerolab trace --stage 3`` (or 1, 2).

A small GPT is sharded with ``zero.shard`` on 2 local gloo ranks and trained for one warm-up
step; the next step is then told, in order, as rank 0 sees it: each unit's hooks (the four
of ``zero/core/hooks.py``), each collective (from the ledger, when it was issued and when its
``wait()`` returned), the end of backward and the optimizer step, with the parameter and
gradient bytes the rank holds just after each event.

Everything is watched from the outside; zero records nothing for it but its ledger:
- hooks of our own on each unit's module, registered around zero's: a forward pre-hook that
  runs *before* zero's ``pre_forward``, a forward hook that runs *after* its ``post_forward``,
  a hook on each output tensor that runs before zero's ``pre_backward``, and a hook on the
  unit's flat parameter that runs when its gradient is complete, before ``post_backward``;
- a ``zero.Ledger(on_record=...)`` that notes what the rank holds as each record arrives, and
  again as its ``wait()`` returns (the record's ``done`` being set: ``_Watched``);
- a post-accumulate-grad hook on each unit's flat parameter, registered after zero's: it runs
  once ``post_backward`` has issued the reduce-scatter and (stage 3) freed the parameters;
- what the rank holds: the bytes of the distinct storages behind the units' parameters
  (``unsharded``, ``sharded``) and gradients (the full flat gradient, a reduction in flight,
  a reduced shard, ``p.grad``), read from each unit's ``held()``, never changed.

All events happen on the rank's main thread (a collective's ``done`` is when ``wait()``
returned there), so their order is the program's and the same on every run; only the
times in the first column vary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import zero
from zero.comm.ledger import Record
from zero.core.tree import tensors_in
from zerolab.launch import run_ranks
from zerolab.models import GPT, GPTConfig

OPS = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
       "all_reduce": "all-reduce", "broadcast": "broadcast", "agree": "agree"}


@dataclass
class Event:
    """One line of the narration."""

    time: float  # time.perf_counter()
    unit: str
    what: str
    held: tuple[int, int, list[str]] | None = None  # parameter bytes, gradient bytes, full units
    record: Any = None  # the ledger record, for a collective
    done: bool = False  # the record's wait() returned (not its issue)


@dataclass
class Trace:
    stage: int
    world_size: int
    config: GPTConfig
    units: list[tuple[str, int]]  # (name, padded numel), forward order
    psi: int  # parameters
    optimizer_bytes: int
    events: list[Event] = field(default_factory=list)
    records: list[Any] = field(default_factory=list)  # the step's ledger, in issue order


class _Watched(Record):
    """A ledger record that calls ``on_done`` when its ``done`` is set (its ``wait()``
    returned): the trace's only view of that instant, taken from the outside."""

    on_done: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "done" and value is not None and type(self).on_done is not None:
            type(self).on_done(self)


def held(units, extra_grads: int = 0) -> tuple[int, int, list[str]]:
    """Bytes of parameters and of gradients this rank holds now, and the units held whole.

    ``extra_grads``: gradient bytes alive that no unit points at yet (or any more): a flat
    gradient arriving at its leaf, or the input of a reduce-scatter being issued.
    """
    seen: set[int] = set()

    def size(t) -> int:  # each storage once: a shard may live inside its full buffer
        if t is None:
            return 0
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    now = [u.held() for u in units]
    params = sum(size(h.unsharded) + size(h.sharded) for h in now)
    grads = extra_grads
    for u, h in zip(units, now):
        for t in [h.gradient, h.reducing, h.reduced, h.unsynced, *(p.grad for p in u.params)]:
            grads += size(t)
    full = [u.name for u, h in zip(units, now) if h.unsharded.untyped_storage().nbytes()]
    return params, grads, full


def _step(rank: int, n: int, stage: int, config: GPTConfig) -> Trace | None:
    torch.manual_seed(0)
    model = GPT(config)
    for unit in model.units():
        zero.shard(unit, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(i):
        return model.batch(2, torch.Generator().manual_seed(10 * i + rank))

    x, y = batch(0)  # the warm-up step: zero learns the units' order, AdamW makes its state
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()

    units = zero.units_of(model)
    events: list[Event] = []

    in_backward, freed = [], set()  # (reduced full gradients already narrated as freed)

    def check_freed(at: float, extra: int = 0) -> None:
        """In backward, a full gradient is freed when zero is done waiting for its
        reduce-scatter, with no hook of ours at that instant: narrate it at the next event
        that sees it (gradient bytes fell), just before that event (at ``at``)."""
        waited = [e.record.unit for e in events if e.done and e.record.op == "reduce_scatter"
                  and e.record.unit not in freed]
        last = next((e.held for e in reversed(events) if e.held is not None), None)
        if in_backward and waited and last is not None:
            now = held(units, extra)
            if now[1] < last[1]:
                freed.add(waited[-1])
                events.append(Event(at - 1e-9, waited[-1],
                                    "full gradient freed, its shard kept", now))

    def note(unit: str, what: str, arriving: int = 0) -> None:
        at = time.perf_counter()
        check_freed(at)  # (a gradient arriving now did not exist when another was freed)
        events.append(Event(at, unit, what, held(units, arriving)))

    def seen(record) -> None:
        # A reduce-scatter's input is alive while it is issued, though the unit has already
        # let go of it and has not yet recorded the reduction in flight.
        reducing = record.buffer_bytes if record.op == "reduce_scatter" else 0
        check_freed(record.time, reducing)
        events.append(Event(record.time, record.unit, "", held(units, reducing), record))
        if record.done is None and type(record) is Record:
            record.__class__ = _Watched  # note what the rank holds as its wait() returns

    def finished(record) -> None:
        check_freed(record.done)
        events.append(Event(record.done, record.unit, "", held(units), record, done=True))

    stage_frees = not units[0].config.stage.keep_params
    for u in units:
        reached = []  # backward reached this unit's output (its first output tensor only)

        def pre_forward(module, args, u=u):
            note(u.name, "pre_forward")

        def backward_reached(grad, u=u, reached=reached):
            if not reached:
                reached.append(True)
                note(u.name, "pre_backward")

        def hook_outputs(module, args, out, hook=backward_reached, reached=reached):
            for t in tensors_in(out):  # before zero's post_forward: our tensor hooks then
                if t.requires_grad:    # run before its pre_backward
                    t.register_hook(hook)
            reached.clear()

        def post_forward(module, args, out, u=u):
            if stage_frees and not u.is_unsharded:
                note(u.name, "post_forward: frees its full parameters")
            elif stage_frees:
                note(u.name, "post_forward: keeps its parameters for backward")
            else:
                note(u.name, "post_forward")

        u.modules[0].register_forward_pre_hook(pre_forward, prepend=True)
        u.modules[0].register_forward_hook(hook_outputs, prepend=True)
        u.modules[0].register_forward_hook(post_forward)
        if u.unsharded.requires_grad:  # runs as the flat gradient arrives, before post_backward
            u.unsharded.register_hook(lambda grad, u=u: note(
                u.name, f"post_backward: gradient complete, {_b(grad.nbytes)}", grad.nbytes))
            if stage_frees:  # after zero's post_backward (its hook was registered first)
                u.unsharded.register_post_accumulate_grad_hook(lambda p, u=u: note(
                    u.name, "post_backward: frees its full parameters")
                    if not u.is_unsharded else None)
    opt.register_step_pre_hook(lambda *a: note("", "opt.step(): AdamW updates this rank's shards"))
    opt.register_step_post_hook(lambda *a: note("", "opt.step() returns"))

    ledger = zero.Ledger(on_record=seen)
    x, y = batch(1)
    start = time.perf_counter()
    _Watched.on_done = finished
    with ledger:
        note("", "forward: loss = model(x)")
        loss = model.loss(model(x), y)
        loss.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(
            lambda: note("", "autograd is done: the end-of-backward callback")))
        note("", "backward: loss.backward()")
        in_backward.append(True)
        loss.backward()
        note("", "backward returns: the shards are in p.grad")
        in_backward.clear()
        opt.step()
        opt.zero_grad()
        note("", "opt.zero_grad(): the gradients are dropped")
    _Watched.on_done = None
    for r in ledger.records:
        if r.done is not None and type(r) is not _Watched:  # done at once (no wait to watch)
            events.append(Event(r.done, r.unit, "", None, r, done=True))
    events.sort(key=lambda e: e.time)  # a stable sort: program order
    for e in events:
        e.time -= start
    if rank != 0:
        return None
    opt_bytes = sum(t.untyped_storage().nbytes() for s in opt.state.values()
                    for t in s.values() if torch.is_tensor(t))
    return Trace(stage, n, config, [(u.name, u.layout.padded_numel) for u in units],
                 sum(u.layout.numel for u in units), opt_bytes, events, list(ledger.records))


def trace(stage: int, layers: int = 2, dim: int = 32, world_size: int = 2) -> Trace:
    """Run the step on ``world_size`` local ranks; rank 0's trace."""
    return run_ranks(_step, world_size, stage, GPTConfig(dim=dim, layers=layers))[0]


# ---- the narration ----------------------------------------------------------------------

def _b(nbytes: int) -> str:
    return f"{nbytes} B"


def _collective(e: Event, current: str) -> str:
    r = e.record
    op = OPS.get(r.op, r.op)
    if e.done:
        return f"{op} done"
    if r.op == "agree":
        return f"agree on the next step, {_b(r.buffer_bytes)}"
    if r.op == "all_gather":
        why = ""
        if r.phase == "step":
            why = ", after opt.step()"
        elif r.unit != current:
            why = ", prefetch"
        return f"{op} issued, sends {_b(r.sent_bytes)}{why}"
    if r.op == "all_reduce" and r.dtype == torch.uint8:
        return f"{op}: used-parameter flags, sends {_b(r.sent_bytes)}"
    return f"{op} issued, sends {_b(r.sent_bytes)}"


def narrate(t: Trace) -> list[str]:
    """The trace as lines of plain text; only the first column (ms) changes between runs."""
    names = ", ".join(f"{name} {numel}" for name, numel in t.units)
    out = [f"ZeRO-{t.stage}: one training step of a GPT ({t.config.layers} blocks, dim "
           f"{t.config.dim}, Ψ = {t.psi}) on {t.world_size} gloo ranks, rank 0's view.",
           f"Units, padded numel (fp32): {names}. AdamW state: {_b(t.optimizer_bytes)}.",
           "A collective is issued, then done when its wait() returns; the issued row says what "
           "this rank sends.",
           "R = 4 x Ψ x (N-1)/N bytes: one all-gather (or reduce-scatter) of every parameter.",
           "params, grads: bytes this rank holds just after the event; full: units whose full "
           "parameters exist.",
           "",
           f"{'ms':>7}  {'unit':<9} {'event':<52} {'params':>7} {'grads':>7}  full"]
    current = ""
    every = [u for u, _ in t.units]
    events = t.events
    i = 0
    while i < len(events):
        e = events[i]
        unit = e.unit
        if e.record is None:
            what = e.what
            if what.startswith(("pre_forward", "pre_backward")):
                current = e.unit
        else:
            what = _collective(e, current)
            if e.record.op == "agree":
                unit = ""
            nxt = events[i + 1] if i + 1 < len(events) else None
            if not e.done and nxt is not None and nxt.done and nxt.record is e.record:
                what += " (waited)"
                e = Event(e.time, e.unit, e.what, nxt.held or e.held, e.record)  # as it returns
                i += 1  # a collective waited for at once: one line
        cells = ""
        if e.held is not None:
            params, grads, full = e.held
            full_s = "all" if full == every else ", ".join(full) or "none"
            cells = f" {params:>7} {grads:>7}  {full_s}"
        out.append(f"{e.time * 1e3:7.2f}  {unit:<9} {what:<52}{cells}".rstrip())
        i += 1
    sent = {op: sum(r.sent_bytes for r in t.records if r.op == op) for op in OPS}
    counts = {op: sum(r.op == op for r in t.records) for op in OPS}
    big = sent["all_gather"] + sent["reduce_scatter"]
    ring = 4 * t.psi * (t.world_size - 1) / t.world_size
    parts = [f"{counts[op]} {OPS[op]}{'s' if counts[op] > 1 else ''} {_b(sent[op])}"
             for op in OPS if counts[op]]
    out += ["", "sent by this rank, in all (ring accounting): " + ", ".join(parts[:2]) + ",",
            "  " + ", ".join(parts[2:]),
            f"all-gathers + reduce-scatters: {_b(big)} = {big / ring:.3f} R "
            f"(R = 4 x {t.psi} x (N-1)/N = {_b(round(ring))})"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace's flags (``python -m zerolab trace`` and ``python -m zerolab.trace``)."""
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    parser.add_argument("--layers", type=int, default=2, help="GPT blocks, 1 to 16 (default 2)")
    parser.add_argument("--dim", type=int, default=32, help="width, a multiple of 4 (default 32)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="local ranks, 2 to 8 (default 2)")


def main(argv: list[str] | None = None) -> None:
    """``python -m zerolab.trace``, the same as ``python -m zerolab trace``."""
    parser = argparse.ArgumentParser(prog="python -m zerolab.trace", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv if argv is not None else sys.argv[1:]), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not 1 <= args.layers <= 16:
        parser.error(f"--layers must be between 1 and 16, got {args.layers}")
    if args.dim <= 0 or args.dim % 4 or args.dim > 1024:
        parser.error(f"--dim must be a multiple of 4 (the heads) up to 1024, got {args.dim}")
    if not 2 <= args.world_size <= 8:
        parser.error(f"--world-size must be between 2 and 8, got {args.world_size}")
    os.environ.setdefault("ZERO_CHECK", "0")
    print("\n".join(narrate(trace(args.stage, args.layers, args.dim, args.world_size))))


if __name__ == "__main__":
    main()
