"""Every collective this package issues, and the ledger that counts them.

This is the only module that calls ``torch.distributed`` collectives, so the ledger sees all
traffic. A record says what moved, for which unit and in which phase of the step::

    with zero.Ledger() as ledger:
        loss = model(x).sum(); loss.backward(); opt.step()
    ledger.sent_bytes()                      # bytes this rank sent in that step
    ledger.sent_bytes(op="all_gather", phase="forward")

Bytes sent follow the standard ring accounting (each rank sends (N-1)/N of the full buffer
for an all-gather or a reduce-scatter, twice that for an all-reduce), which is how the ZeRO
paper counts Ψ and 2Ψ (section 7).

Every wrapper takes ``async_op``: with ``True`` it returns a handle whose ``wait()`` must be
called before the output is read, as with ``torch.distributed``.

A group of one rank has nobody to talk to: there the wrappers do the local equivalent (a
copy, or nothing) and record nothing, so world size 1 issues no collective, as FSDP2.

[Note: agreement] A collective pairs with whatever collective the other ranks issue next.
Ranks that took different paths (one skipped a unit, or backward, or ``opt.step()``)
therefore wait forever, or worse, exchange the wrong unit's data. ``agree(what)`` makes
every rank state what it is about to do, in one small all-gather, and raises on every rank,
naming what each was doing, if they differ. zero agrees at the points that decide what
follows (the start of each forward, shard, clip, the state-dict and checkpoint helpers);
with ``ZERO_CHECK=1`` in the environment, before every collective as well, so that no
divergence goes unnoticed (at the price of one more small collective each). In check mode
an agreement also gives up after ``ZERO_TIMEOUT`` seconds (default 60): a rank left alone in
a collective raises instead of hanging until the process group's own timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


@dataclass
class Record:
    """One collective as seen by this rank."""

    op: str  # "all_gather", "reduce_scatter", "all_reduce", "broadcast" or "agree"
    dtype: torch.dtype
    buffer_bytes: int  # size of the full (unsharded) buffer
    sent_bytes: int  # what this rank sends under ring accounting
    unit: str
    phase: str  # "init", "forward", "backward", "step", "agree" or "other"
    time: float  # time.perf_counter() when it was issued (a timeline of one step)
    group: str = "world"  # which group it crossed (``name_group``): "intra-node"...
    ranks: int = 1  # how many ranks that group has
    done: float | None = None  # when this rank's wait() for it returned (None: not yet)


class Ledger:
    """Records the collectives issued while it is active (``with Ledger() as ledger:``).

    Ledgers nest; every active ledger receives every record.
    """

    def __init__(self) -> None:
        self.records: list[Record] = []

    def __enter__(self) -> "Ledger":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)

    def reset(self) -> None:
        self.records.clear()

    def select(self, op: str | None = None, phase: str | None = None, unit: str | None = None,
               group: str | None = None):
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (phase is None or r.phase == phase)
            and (unit is None or r.unit == unit)
            and (group is None or r.group == group)
        ]

    def sent_bytes(self, op: str | None = None, phase: str | None = None,
                   group: str | None = None) -> int:
        return sum(r.sent_bytes for r in self.select(op, phase, group=group))

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))


_ACTIVE: list[Ledger] = []


_GROUP_NAMES: dict[Any, str] = {}


def name_group(group, name: str) -> None:
    """Give ``group`` a name for the ledger (HSDP's "shard" and "replicate" groups)."""
    _GROUP_NAMES[dist.group.WORLD if group is None else group] = name


def group_name(group) -> str:
    group = dist.group.WORLD if group is None else group
    default = "world" if group is dist.group.WORLD else f"{dist.get_world_size(group)} ranks"
    return _GROUP_NAMES.get(group, default)


def _record(op: str, buffer: torch.Tensor, factor: float, group, unit: str, phase: str):
    if not _ACTIVE:
        return None
    n = dist.get_world_size(group)
    nbytes = buffer.numel() * buffer.element_size()
    rec = Record(op, buffer.dtype, nbytes, int(nbytes * factor * (n - 1) / n), unit, phase,
                 time.perf_counter(), group_name(group), n)
    for ledger in _ACTIVE:
        ledger.records.append(rec)
    return rec


class _Timed:
    """A collective's handle that notes, in its record, when ``wait()`` returned (on NCCL that
    is when the current stream was told to wait, not when the bytes arrived)."""

    def __init__(self, work, record: Record):
        self.work, self.record = work, record

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        if self.record.done is None:
            self.record.done = time.perf_counter()
        return out


def _issue(op: str, buffer, factor: float, group, unit: str, phase: str, async_op: bool,
           launch):
    """Agree (check mode), record, launch; a handle that times its wait."""
    _check(op, buffer, group, unit, phase)
    rec = _record(op, buffer, factor, group, unit, phase)
    work = launch()
    if rec is not None and not async_op:
        rec.done = time.perf_counter()
    return _Timed(work, rec) if rec is not None and async_op else work


class _Done:
    """The handle of a collective that had nothing to do: a group of one rank."""

    def wait(self) -> bool:
        return True


def _alone(group) -> bool:
    return dist.get_world_size(group) == 1


def _done(async_op: bool):
    return _Done() if async_op else None


def _check(op: str, buffer: torch.Tensor, group, unit: str, phase: str) -> None:
    if checking():
        agree(f"{op} {unit or '(no unit)'} in {phase} ({buffer.numel()} x {buffer.dtype})",
              group=group, device=buffer.device,
              fix="Every rank must run the same units in the same order: the same forward "
                  "calls, the same no_sync micro-batches, backward and opt.step() on all ranks")


def all_gather(output, input, *, group=None, unit="", phase="other", async_op=False):
    """(shard,) on every rank -> (N * shard,) on every rank, rank r's shard at [r * shard, ...).

    ``input`` may be rank r's slice of ``output`` (an in-place all-gather).
    """
    if _alone(group):  # the shard is the whole
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _done(async_op)
    return _issue("all_gather", output, 1.0, group, unit, phase, async_op,
                  lambda: _all_gather_flat(output, input, group=group, async_op=async_op))


def reduce_scatter(output, input, *, op="avg", group=None, unit="", phase="other", async_op=False):
    """(N * shard,) on every rank -> (shard,): rank r gets slice r of the sum (or mean) over ranks."""
    if _alone(group):  # the sum (or mean) of one
        output.copy_(input)
        return _done(async_op)
    return _issue("reduce_scatter", input, 1.0, group, unit, phase, async_op,
                  lambda: _reduce_scatter_flat(output, input, op=_OPS[op], group=group,
                                               async_op=async_op))


def all_reduce(tensor, *, op="sum", group=None, unit="", phase="other", async_op=False):
    """Any shape -> the same shape, reduced over ranks (``op`` in "sum", "avg", "max"), in place."""
    if _alone(group):
        return _done(async_op)
    return _issue("all_reduce", tensor, 2.0, group, unit, phase, async_op,
                  lambda: dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op))


def broadcast(tensor, *, src: int = 0, group=None, unit="", phase="other", async_op=False):
    """Any shape -> the same shape on every rank: rank ``src``'s values, in place."""
    if _alone(group):
        return _done(async_op)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    return _issue("broadcast", tensor, 1.0, group, unit, phase, async_op,
                  lambda: dist.broadcast(tensor, src=global_src, group=group, async_op=async_op))


def all_gather_object(obj: Any, *, group=None) -> list[Any]:
    """Every rank's ``obj`` (pickled); for rare, small metadata such as error reports."""
    if _alone(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def simulated(group=None) -> bool:
    """True for the fake process group (benchmarks/simulate.py): it moves no data and has no
    other ranks, so checks that compare ranks have nothing to compare."""
    return dist.get_backend(group) == "fake"


# ---- agreement: diverging ranks raise instead of hanging (see the module note) -----------

_SEQUENCE: dict[Any, int] = {}  # agreements so far, per group: ranks must count alike


def checking() -> bool:
    """Check mode: agree before every collective (``ZERO_CHECK=1``)."""
    return os.environ.get("ZERO_CHECK", "0") not in ("", "0")


def _fingerprint(what: str) -> int:
    return int.from_bytes(hashlib.blake2b(what.encode(), digest_size=7).digest(), "big")


class Disagreement(RuntimeError):
    """The ranks were about to do different things (``agree``)."""


def default_device(group=None) -> torch.device:
    """Where a small tensor for ``group``'s collectives lives: the CPU for gloo, else the
    current accelerator (NCCL moves only device memory)."""
    accelerator = torch.accelerator.current_accelerator()
    if dist.get_backend(group) in ("gloo", "fake") or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def agree(what: str, *, group=None, device=None, fix: str = "", error=Disagreement) -> None:
    """Every rank of ``group`` says ``what`` it is about to do; raise ``error`` on all of them
    if they do not all say the same. ``fix`` ends the message: how to make the ranks agree."""
    if _alone(group) or simulated(group):
        return
    key = group if group is not None else dist.group.WORLD
    seq = _SEQUENCE[key] = _SEQUENCE.get(key, 0) + 1
    n, device = dist.get_world_size(group), device or default_device(group)
    mine = torch.tensor([_fingerprint(what), seq], dtype=torch.int64, device=device)
    every = torch.empty(2 * n, dtype=torch.int64, device=device)
    rec = _record("agree", every, 1.0, group, "", "agree")
    # (2,) per rank -> (2N,): each rank's fingerprint of what it is about to do, and its count
    work = _all_gather_flat(every, mine, group=group, async_op=True)
    try:
        if checking():
            work.wait(timeout=datetime.timedelta(seconds=float(os.environ.get("ZERO_TIMEOUT", 60))))
        else:
            work.wait()
    except RuntimeError as e:
        raise error(f"rank {dist.get_rank(group)} waited in vain for the other ranks to {what}: "
                    f"they are somewhere else. {fix}".strip()) from e
    if rec is not None:
        rec.done = time.perf_counter()
    rows = every.view(n, 2)
    if (rows != rows[0]).any():
        said = all_gather_object(f"{what} (agreement #{seq})", group=group)
        detail = "; ".join(f"rank {r} is about to {w}" for r, w in enumerate(said))
        raise error(f"the ranks took different paths: {detail}. {fix}".strip())


@contextlib.contextmanager
def raising_together(group=None, device=None):
    """Local checks whose failure on one rank must stop every rank: inside, an exception on
    some rank is announced as an agreement ("raise ..."); the ranks that passed their checks
    see it at their next ``agree`` and raise too, instead of entering a collective that rank
    will never join."""
    try:
        yield
    except Exception as e:
        with contextlib.suppress(Disagreement):  # the others differ, of course: say ours
            agree(f"raise {type(e).__name__}: {e}", group=group, device=device)
        raise
