"""What the collectives layer keeps between calls, in one object per root: a ``CommContext``.

FSDP2's ``FSDPCommContext``: every collective of a model and every question about a group goes
through its root's (notes/15, "One context per root"); code of no model gets a fresh one
(``context_of``).

[Note: streams] On an accelerator the collectives run beside the computation, on the context's
own streams (``Streams``), as FSDP2's. Each side stream first waits for what the computation
queued before it, and the computation waits for the side stream's event (and the collective)
before it reads the result. Memory is never handed between streams with ``record_stream``:
whatever a side stream or a collective reads stays referenced by the work in flight
(``AllGather``, ``Reduction``) until the computing stream has waited for it, as FSDP2's
``AllGatherState``/``ReduceScatterState``. On the CPU torch's stand-ins do nothing (notes/15).

[Note: profiler labels] Each hook, collective and wait runs inside a profiler range named as
FSDP2 names its own, with zero's prefix for FSDP2's (``zero::all_gather (blocks.0)`` beside
``FSDP::all_gather (blocks.0)``; ``label``), so a trace of zero reads beside one of FSDP2.
"""

from __future__ import annotations

import collections

import torch
from torch.profiler import record_function

from zero.comm import ledger, objects, waits
from zero.comm.agree import agree, checking
from zero.comm.backend import TorchBackend


class Handle:
    """A collective in flight: ``wait()`` is bounded, and notes when it returned (its record's)."""

    def __init__(self, work, op: str, name: str, group, record: ledger.Record | None,
                 ctx):
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


def _issue(op: str, buffer, factor: float, group, unit: str, phase: str, async_op: bool,
           ctx: "CommContext", launch):
    """Agree (check mode), record, launch (always async, so even a blocking call's wait is
    bounded); the handle, or its wait's result for a blocking call."""
    what = f"{op} {unit or '(no unit)'} in {phase} ({buffer.numel()} x {buffer.dtype})"
    if checking():
        agree(what, group=group, device=buffer.device, ctx=ctx,
              fix="Every rank must run the same units in the same order: the same forward "
                  "calls, the same no_sync micro-batches, backward and opt.step() on all ranks")
    name = ctx.issued(what, group)
    rec = ledger.record(op, buffer, factor, group, unit, phase, ctx)
    handle = Handle(launch(ctx.backend), op, name, group, rec, ctx)  # (None: waits.wait's)
    return handle if async_op else handle.wait()


class Streams:
    """The device's four streams for the collectives (the module note), and how to use them."""

    def __init__(self, device: torch.device):
        self.module = torch.get_device_module(device)
        high = -1  # (FSDP2's priority: the collectives' kernels ahead of queued computation)
        self.copy_in = self.module.Stream(priority=high)  # casts and host-to-device copies
        self.all_gather = self.module.Stream(priority=high)
        self.reduce_scatter = self.module.Stream(priority=high)  # a gradient's copy-in, reduction
        self.all_reduce = self.module.Stream(priority=high)  # HSDP's, over the replicas

    def current(self):
        return self.module.current_stream()

    def use(self, stream):
        """Run what follows on ``stream``, after what the current stream queued so far."""
        stream.wait_stream(self.current())
        return self.module.stream(stream)

    def wait(self, event) -> None:
        """The current stream waits for ``event`` (None on the CPU: nothing to wait for)."""
        if event is not None:
            self.current().wait_event(event)

    def join(self, stream) -> None:
        """The current stream waits for everything ``stream`` queued so far."""
        self.current().wait_stream(stream)


class CommContext:
    """Args:
    backend: the ``Backend`` every collective goes through (default: ``TorchBackend()``).
    """

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else TorchBackend()
        self._names: dict = {}  # group -> its name in the ledger
        self._counts: dict = {}  # group -> collectives this rank issued on it
        self._sequences: dict = {}  # group -> agreements so far: the ranks must count alike
        self._streams: dict = {}  # device -> its Streams, made at the first collective there
        self._hosts: dict = {}  # group -> (group, device) for host metadata (``host``)
        self.last: collections.deque = collections.deque(maxlen=3)  # the last few issued

    def __repr__(self) -> str:
        return f"CommContext(backend={self.backend!r})"

    # ---- questions about groups, answered by the backend ------------------------------------

    def rank(self, group=None) -> int:
        return self.backend.rank(group)

    def world_size(self, group=None) -> int:
        return self.backend.world_size(group)

    def alone(self, group=None) -> bool:
        """A group of one rank has nobody to talk to."""
        return self.backend.world_size(group) == 1

    def simulated(self, group=None) -> bool:
        """The fake process group (the plan): no data, no other ranks to compare with."""
        return self.backend.name(group) == "fake"

    def default_device(self, group=None) -> torch.device:
        return self.backend.default_device(group)

    def host(self, group=None) -> tuple:
        """``(group, device)`` for host metadata (the note on the host side in
        ``zero/comm/ledger.py``): ``group`` on the CPU where its backend moves host memory
        (gloo); its twin once ``make_host`` has made one; until then ``group`` on its device."""
        return self._hosts.get(self._key(group)) or (group, self.default_device(group))

    def make_host(self, group=None) -> None:
        """Make ``group``'s twin for host metadata (NCCL: the backend's ``host_group``); the root
        calls it after its first forward's agreement, so every rank makes it at the same point."""
        key = self._key(group)
        make = getattr(self.backend, "host_group", None)
        if key in self._hosts or make is None or self.backend.name(group) in ("gloo", "fake"):
            return
        twin = make(group)
        self._names.setdefault(self._key(twin), self.group_name(group))  # (named as group)
        self._hosts[key] = self._hosts[self._key(twin)] = (twin, torch.device("cpu"))

    def streams(self, device: torch.device) -> Streams:
        """The device's streams for the collectives (the module note), made once."""
        key = torch.device(device)
        if key not in self._streams:
            self._streams[key] = Streams(key)
        return self._streams[key]

    # ---- the collectives: agreed (check mode), recorded, launched through the backend ---------

    def _local(self, async_op: bool, output=None, input=None):
        """A group of one rank: the local equivalent (``output`` the copy of ``input``)."""
        if output is not None and output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Done() if async_op else None

    def all_gather(self, output, input, *, group=None, unit: str = "", phase: str = "other",
                   async_op: bool = False):
        """(shard,) per rank -> (N*shard,) on every rank (``collectives.all_gather``'s)."""
        if self.alone(group):  # the shard is the whole
            return self._local(async_op, output, input)
        return _issue("all_gather", output, 1.0, group, unit, phase, async_op, self,
                      lambda b: b.all_gather(output, input, group, async_op=True))

    def reduce_scatter(self, output, input, *, op: str = "avg", group=None, unit: str = "",
                       phase: str = "other", async_op: bool = False):
        """(N * shard,) on every rank -> (shard,): rank r gets slice r of the sum (or mean)."""
        if self.alone(group):  # the sum (or mean) of one
            output.copy_(input)
            return self._local(async_op)
        return _issue("reduce_scatter", input, 1.0, group, unit, phase, async_op, self,
                      lambda b: b.reduce_scatter(output, input, op, group, async_op=True))

    def all_to_all(self, output, input, *, group=None, unit: str = "", phase: str = "other",
                   async_op: bool = False):
        """(N*chunk,) on every rank -> (N*chunk,): rank r's chunk s goes to rank s, as chunk r."""
        if self.alone(group):
            return self._local(async_op, output, input)
        return _issue("all_to_all", input, 1.0, group, unit, phase, async_op, self,
                      lambda b: b.all_to_all(output, input, group, async_op=True))

    def all_reduce(self, tensor, *, op: str = "sum", group=None, unit: str = "",
                   phase: str = "other", async_op: bool = False):
        """Any shape -> the same shape, reduced over ranks ("sum", "avg", "max"), in place."""
        if self.alone(group):
            return self._local(async_op)
        return _issue("all_reduce", tensor, 2.0, group, unit, phase, async_op, self,
                      lambda b: b.all_reduce(tensor, op, group, async_op=True))

    def broadcast(self, tensor, *, src: int = 0, group=None, unit: str = "",
                  phase: str = "other", async_op: bool = False):
        """Any shape -> the same shape on every rank: rank ``src``'s values, in place."""
        if self.alone(group):
            return self._local(async_op)
        return _issue("broadcast", tensor, 1.0, group, unit, phase, async_op, self,
                      lambda b: b.broadcast(tensor, src, group, async_op=True))

    def launch(self, op: str, buffer, start, *, group=None, unit: str = "",
               phase: str = "other", async_op: bool = False):
        """A collective that ``start()`` issues itself (FSDP2's custom objects), recorded with its
        full (N*S,) ``buffer``; ``start()`` returns a handle, or None for a call that has ended."""
        factor = 2.0 if op == "all_reduce" else 1.0
        return _issue(op, buffer, factor, group, unit, phase, async_op, self,
                      lambda b: start())

    def all_gather_object(self, obj, *, group=None) -> list:
        """Every rank's ``obj`` (pickled); for rare, small metadata such as error reports."""
        if self.alone(group):
            return [obj]
        return objects.all_gather_object(obj, group, self)

    # ---- what the ledger and the messages need ----------------------------------------------

    def _key(self, group):
        return self.backend.world() if group is None else group

    def name_group(self, group, name: str) -> None:
        """Give ``group`` a name for the ledger (HSDP's "intra-node" and "inter-node")."""
        self._names[self._key(group)] = name

    def group_name(self, group) -> str:
        key = self._key(group)
        default = "world" if key is self.backend.world() else \
            f"{self.backend.world_size(group)} ranks"
        return self._names.get(key, default)

    def issued(self, what: str, group) -> str:
        """Number a collective this rank issues on ``group``; returns how messages name it."""
        key = self._key(group)
        n = self._counts[key] = self._counts.get(key, 0) + 1
        name = f"#{n} {what}"
        self.last.append(name)
        return name

    def next_agreement(self, group) -> int:
        key = self._key(group)
        self._sequences[key] = self._sequences.get(key, 0) + 1
        return self._sequences[key]

    def take_names(self, other: "CommContext") -> None:
        """Keep the group names of a context whose units this one takes over."""
        for key, name in other._names.items():
            self._names.setdefault(key, name)


def finish(work) -> None:
    """End a collective through its handle (None: a blocking call that had finished)."""
    if work is not None:
        work.wait()


def label(what: str, unit: str = "") -> record_function:
    """A profiler range named as FSDP2's are (the module's note on labels)."""
    return record_function(f"zero::{what} ({unit})" if unit else f"zero::{what}")


def context_of(ctx: "CommContext | None") -> "CommContext":
    """``ctx``, or a fresh default context for a call that gave none."""
    return ctx if ctx is not None else CommContext()
