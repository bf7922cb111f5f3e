"""The collectives as functions: ``zero.comm.all_gather(output, input, group=..., ctx=...)``.

Each is ``CommContext``'s of the same name (a fresh default context without ``ctx``): recorded,
agreed in check mode, its wait bounded; with ``async_op=True`` a handle to ``wait()`` on. A
group of one rank does the local equivalent and records nothing, as FSDP2.
"""

from __future__ import annotations

from typing import Any

from zero.comm.context import CommContext, context_of


def all_gather(output, input, *, group=None, unit="", phase="other", async_op=False,
               ctx: CommContext | None = None):
    """(shard,) on every rank -> (N * shard,) on every rank, rank r's shard at [r * shard, ...);
    ``input`` may be rank r's slice of ``output`` (in place)."""
    return context_of(ctx).all_gather(output, input, group=group, unit=unit, phase=phase,
                                      async_op=async_op)


def reduce_scatter(output, input, *, op="avg", group=None, unit="", phase="other",
                   async_op=False, ctx: CommContext | None = None):
    """(N * shard,) on every rank -> (shard,): rank r gets slice r of the sum (or mean)."""
    return context_of(ctx).reduce_scatter(output, input, op=op, group=group, unit=unit,
                                          phase=phase, async_op=async_op)


def all_to_all(output, input, *, group=None, unit="", phase="other", async_op=False,
               ctx: CommContext | None = None):
    """(N * chunk,) on every rank -> (N * chunk,): rank r's chunk s goes to rank s, as chunk r."""
    return context_of(ctx).all_to_all(output, input, group=group, unit=unit, phase=phase,
                                      async_op=async_op)


def all_reduce(tensor, *, op="sum", group=None, unit="", phase="other", async_op=False,
               ctx: CommContext | None = None):
    """Any shape -> the same shape, reduced over ranks (``op`` in "sum", "avg", "max"), in place."""
    return context_of(ctx).all_reduce(tensor, op=op, group=group, unit=unit, phase=phase,
                                      async_op=async_op)


def broadcast(tensor, *, src: int = 0, group=None, unit="", phase="other", async_op=False,
              ctx: CommContext | None = None):
    """Any shape -> the same shape on every rank: rank ``src``'s values, in place."""
    return context_of(ctx).broadcast(tensor, src=src, group=group, unit=unit, phase=phase,
                                     async_op=async_op)


def all_gather_object(obj: Any, *, group=None, ctx: CommContext | None = None) -> list[Any]:
    """Every rank's ``obj`` (pickled); for rare, small metadata such as error reports."""
    return context_of(ctx).all_gather_object(obj, group=group)
