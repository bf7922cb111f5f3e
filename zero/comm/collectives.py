"""Every collective the mechanism issues: agreed (check mode), recorded, launched.

Each wrapper is the collective of the same name in ``torch.distributed``, issued through the
backend of the caller's ``CommContext`` (``ctx``: ``zero/comm/context.py``; none given: a fresh
one over ``zero/comm/backend.py``), plus three things: it notes the collective in every active ledger
(``zero/comm/ledger.py``), in check mode it first has the ranks agree on it
(``zero/comm/agree.py``), and its wait is bounded (``zero/comm/waits.py``). Every wrapper takes
``async_op``: with ``True`` it returns a handle whose ``wait()`` must be called before the
output is read, as with ``torch.distributed``.

A group of one rank has nobody to talk to: there the wrappers do the local equivalent (a
copy, or nothing) and record nothing, so world size 1 issues no collective, as FSDP2.
"""

from __future__ import annotations

from typing import Any

from zero.comm import backend, ledger, objects, waits
from zero.comm.agree import agree, checking
from zero.comm.context import CommContext, context_of


class Handle:
    """A collective in flight: ``wait()`` is bounded (``zero/comm/waits.py``) and notes, in the
    collective's record, when it returned (on NCCL that is when the current stream was told to
    wait, not when the bytes arrived)."""

    def __init__(self, work, op: str, name: str, group, record: ledger.Record | None,
                 ctx: CommContext):
        self.work, self.op, self.name, self.group, self.record = work, op, name, group, record
        self.ctx = ctx

    def wait(self):
        out = waits.wait(self.work, self.name, self.group, self.ctx, op=self.op)
        ledger.done(self.record)
        return out


class Done:
    """The handle of a collective that had nothing to do: a group of one rank."""

    def wait(self, *args, **kwargs) -> bool:
        return True


def _done(async_op: bool):
    return Done() if async_op else None


def _issue(op: str, buffer, factor: float, group, unit: str, phase: str, async_op: bool,
           ctx: CommContext, launch):
    """Agree (check mode), record, launch (always asynchronously, so that even a blocking
    call's wait is bounded); the handle, or its wait's result for a blocking call."""
    what = f"{op} {unit or '(no unit)'} in {phase} ({buffer.numel()} x {buffer.dtype})"
    if checking():
        agree(what, group=group, device=buffer.device, ctx=ctx,
              fix="Every rank must run the same units in the same order: the same forward "
                  "calls, the same no_sync micro-batches, backward and opt.step() on all ranks")
    name = ctx.issued(what, group)
    rec = ledger.record(op, buffer, factor, group, unit, phase, ctx)
    handle = Handle(launch(ctx.backend), op, name, group, rec, ctx)
    return handle if async_op else handle.wait()


def all_gather(output, input, *, group=None, unit="", phase="other", async_op=False, ctx=None):
    """(shard,) on every rank -> (N * shard,) on every rank, rank r's shard at [r * shard, ...).

    ``input`` may be rank r's slice of ``output`` (an in-place all-gather).
    """
    if backend.alone(group):  # the shard is the whole
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _done(async_op)
    return _issue("all_gather", output, 1.0, group, unit, phase, async_op, context_of(ctx),
                  lambda b: b.all_gather(output, input, group, async_op=True))


def reduce_scatter(output, input, *, op="avg", group=None, unit="", phase="other",
                   async_op=False, ctx=None):
    """(N * shard,) on every rank -> (shard,): rank r gets slice r of the sum (or mean) over ranks."""
    if backend.alone(group):  # the sum (or mean) of one
        output.copy_(input)
        return _done(async_op)
    return _issue("reduce_scatter", input, 1.0, group, unit, phase, async_op, context_of(ctx),
                  lambda b: b.reduce_scatter(output, input, op, group, async_op=True))


def all_to_all(output, input, *, group=None, unit="", phase="other", async_op=False, ctx=None):
    """(N * chunk,) on every rank -> (N * chunk,): rank r's chunk s goes to rank s, as chunk r.
    Each rank keeps one chunk of its own and sends the other (N-1)/N."""
    if backend.alone(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _done(async_op)
    return _issue("all_to_all", input, 1.0, group, unit, phase, async_op, context_of(ctx),
                  lambda b: b.all_to_all(output, input, group, async_op=True))


def all_reduce(tensor, *, op="sum", group=None, unit="", phase="other", async_op=False,
               ctx=None):
    """Any shape -> the same shape, reduced over ranks (``op`` in "sum", "avg", "max"), in place."""
    if backend.alone(group):
        return _done(async_op)
    return _issue("all_reduce", tensor, 2.0, group, unit, phase, async_op, context_of(ctx),
                  lambda b: b.all_reduce(tensor, op, group, async_op=True))


def broadcast(tensor, *, src: int = 0, group=None, unit="", phase="other", async_op=False,
              ctx=None):
    """Any shape -> the same shape on every rank: rank ``src``'s values, in place."""
    if backend.alone(group):
        return _done(async_op)
    return _issue("broadcast", tensor, 1.0, group, unit, phase, async_op, context_of(ctx),
                  lambda b: b.broadcast(tensor, src, group, async_op=True))


def all_gather_object(obj: Any, *, group=None, ctx=None) -> list[Any]:
    """Every rank's ``obj`` (pickled); for rare, small metadata such as error reports."""
    if backend.alone(group):
        return [obj]
    return objects.all_gather_object(obj, group, context_of(ctx))
