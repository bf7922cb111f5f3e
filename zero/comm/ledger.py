"""The ledger: every collective zero issues, as this rank saw it.

A record says what moved, for which unit and in which phase of the step (notes/02 reads one)::

    with zero.Ledger() as ledger:
        loss = model(x).sum(); loss.backward(); opt.step()
    ledger.sent_bytes()                      # bytes this rank sent in that step
    ledger.sent_bytes(op="all_gather", phase="forward")

Bytes sent follow ring accounting ((N-1)/N of the full buffer for an all-gather or a
reduce-scatter, twice that for an all-reduce), as the ZeRO paper counts Ψ and 2Ψ (section 7).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

# The ledgers active here: a context variable (disk offload's I/O thread runs in a copy of it).
_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("zero_ledgers", default=())

# [Note: host side] The agreement and backward's used flags carry only what the host knows:
# through ``CommContext.host(group)`` (on NCCL a gloo group of the same ranks), reading them never
# waits for the device's queued work. ``on_host()`` marks them (``zerolab/emulate.py``'s timeline).
_ON_HOST: contextvars.ContextVar[bool] = contextvars.ContextVar("zero_on_host", default=False)


@contextlib.contextmanager
def on_host():
    """What is issued inside carries host metadata (the note on the host side)."""
    token = _ON_HOST.set(True)
    try:
        yield
    finally:
        _ON_HOST.reset(token)


def host_side() -> bool:
    """Whether the collective being issued now is host metadata (``on_host``)."""
    return _ON_HOST.get()


@dataclass
class Record:
    """One collective as seen by this rank."""

    op: str  # "all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast", "agree";
    #          or a copy, which sends nothing: "h2d", "d2h" (CPU offload), "read", "write" (disk)
    dtype: torch.dtype
    buffer_bytes: int  # size of the full (unsharded) buffer
    sent_bytes: int  # what this rank sends under ring accounting
    unit: str
    phase: str  # "init", "forward", "backward", "step", "agree" or "other"
    time: float  # time.perf_counter() when it was issued (a timeline of one step)
    group: str = "world"  # which group it crossed (``CommContext.name_group``): "intra-node"
    ranks: int = 1  # how many ranks that group has
    done: float | None = None  # when this rank's wait() for it returned (None: not yet)


class Ledger:
    """Records the collectives issued while it is active (``with Ledger() as ledger:``);
    ledgers nest, and every active one receives every record.

    Args:
        on_record: called with each record as it is made (an observer: a trace, a timeline).
    """

    def __init__(self, on_record: Callable[[Record], None] | None = None) -> None:
        self.records: list[Record] = []
        self.on_record = on_record

    def __enter__(self) -> "Ledger":
        _ACTIVE.set((*_ACTIVE.get(), self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.set(tuple(lg for lg in _ACTIVE.get() if lg is not self))

    def reset(self) -> None:
        self.records.clear()

    def select(self, op: str | None = None, phase: str | None = None, unit: str | None = None,
               group: str | None = None):
        return [r for r in self.records if (op is None or r.op == op)
                and (phase is None or r.phase == phase) and (unit is None or r.unit == unit)
                and (group is None or r.group == group)]

    def sent_bytes(self, op: str | None = None, phase: str | None = None,
                   group: str | None = None) -> int:
        return sum(r.sent_bytes for r in self.select(op, phase, group=group))

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))


def record(op: str, buffer: torch.Tensor, factor: float, group, unit: str, phase: str,
           ctx) -> Record | None:
    """Note a collective about to launch in every active ledger (None if none), its group's."""
    active = _ACTIVE.get()
    if not active:
        return None
    n = ctx.world_size(group)
    nbytes = buffer.numel() * buffer.element_size()
    rec = Record(op, buffer.dtype, nbytes, int(nbytes * factor * (n - 1) / n), unit, phase,
                 time.perf_counter(), ctx.group_name(group), n)
    _note(active, rec)
    return rec


def _note(active: tuple, rec: Record) -> None:
    for ledger in active:
        ledger.records.append(rec)
        if ledger.on_record is not None:
            ledger.on_record(rec)


def record_copy(kind: str, tensor: torch.Tensor, unit: str, phase: str) -> Record | None:
    """Note a copy, host and device ("h2d", "d2h") or memory and disk ("read", "write")."""
    active = _ACTIVE.get()
    if not active:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    now = time.perf_counter()
    where = "disk" if kind in ("read", "write") else "host"
    rec = Record(kind, tensor.dtype, nbytes, 0, unit, phase, now, where, 1, done=now)
    _note(active, rec)
    return rec


def done(rec: Record | None) -> None:
    """This rank's wait for ``rec``'s collective returned (the first time only)."""
    if rec is not None and rec.done is None:
        rec.done = time.perf_counter()
