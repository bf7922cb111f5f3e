"""Disk offload (ZeRO-Infinity's NVMe tier, on any file system): the optimizer state in files.

ZeRO-Offload (``zero/features/offload.py``) frees the accelerator of the model states and puts them on
the host; ZeRO-Infinity (Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for
Extreme Scale Deep Learning", SC21) goes one tier further, and this file takes its largest
part there: the optimizer state (AdamW's two moments, 8 bytes a parameter against the shard's
4) lives in one file per unit, and a rank holds the state of at most two units in memory. The
shards and their gradients stay on the host, as with CPU offload, and the step runs there.

torch's optimizers step a whole parameter group in one call and read every parameter's state
first (AdamW's ``_init_group``), so the step is split here, unit by unit. This policy owns
that part of the step (``before_step``, called by zero's step pre-hook on the optimizer,
``zero/surface/attach.py``, which runs after the user's own pre-hooks: a warm-up that sets this
step's lr has set it before any unit is stepped)::

    opt.step():  user's pre-hooks
                 zero's pre-hook: for each unit k (the same order on every rank):
                     read unit k+1's file in the background     (disk -> memory)
                     opt's own step over unit k's parameters only, their state put back
                     write unit k's state back in the background (memory -> disk), drop it
                 the call itself: over the parameters no unit holds (none, usually)
                 post-hook: as for any optimizer

Stepping a unit's parameters apart from the rest computes, parameter by parameter, what one
call computes: every optimizer that zero steps on pieces updates each parameter on its own
(``zero/core/optimizers.py``'s ``ELEMENTWISE``, checked below), so the bits are those of the
in-memory run (tests/features/test_disk_offload.py). What is read and written is counted in the ledger
("read" and "write" records, bytes moved, none sent), and ``held_bytes`` / ``peak_bytes`` say
how much state the store holds in memory. Each unit's state is keyed by the unit itself,
never by its name (which the root changes at the first forward, from the module's class to
its path): a resume or a save before any forward, and two separately sharded models in one
optimizer, find their own state.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from zero.comm import ledger
from zero.core import registry
from zero.features.offload import CPUOffload
from zero.core.optimizers import ELEMENTWISE
from zero.features.disk_files import StateFileError, StateFiles

ALIGN = 64  # bytes: every state tensor starts at a multiple of this in its unit's buffer


@dataclass(frozen=True, init=False)
class DiskOffload(CPUOffload):
    """The shards on the host (``CPUOffload``), the optimizer state in files under ``directory``.

    Args:
        directory: where each rank makes its own directory of state files (a local SSD, say);
            it need not be the same path on every rank.
        pin_memory: as ``CPUOffload``'s.
    """

    # (not in the repr, which the ranks compare: it may differ per rank; set by __init__)
    directory: str = field(repr=False, kw_only=True)

    def __init__(self, directory: str | os.PathLike, pin_memory: bool = True):
        super().__init__(pin_memory=pin_memory)
        object.__setattr__(self, "directory", os.fspath(directory))  # (frozen)

    def check(self, layout) -> None:
        if layout.exposes_dtensors:  # (its state is DTensors: the buffers would need wrapping)
            raise ValueError("DiskOffload does not support layout='rows' yet (the optimizer "
                             "state of DTensor parameters is DTensors): use layout='flat' or "
                             "'whole', or CPUOffload with 'rows'")

    def store(self, optimizer) -> "StateStore":
        """The optimizer's store of state files (made at its first step)."""
        stores = optimizer.__dict__.setdefault("_zero_disk_stores", {})
        if self not in stores:
            stores[self] = StateStore(self.directory)
        return stores[self]

    def before_step(self, optimizer, units: list, args: tuple, kwargs: dict):
        """This policy's part of ``opt.step()``: step ``units`` (this policy's, in the
        optimizer's order) one by one, each unit's state read from its file and written back;
        returns the call's arguments, the optimizer replaced by a stand-in that holds only
        the parameters no such unit holds, for torch to step as usual."""
        kind = type(optimizer).__name__
        own_step = getattr(type(optimizer).step, "__wrapped__", None)
        if kind not in ELEMENTWISE or own_step is None:
            raise RuntimeError(
                f"DiskOffload steps the optimizer unit by unit, which computes what one step "
                f"does only for an optimizer that updates each parameter on its own; {kind} is "
                f"not one zero knows ({sorted(ELEMENTWISE)}). Use CPUOffload with it")
        if len(args) > 1 or kwargs:
            raise ValueError(
                "opt.step(closure) (or with other arguments) under DiskOffload: the step runs "
                "once per unit, and a closure would be evaluated each time. Compute the loss "
                "and backward first, then call opt.step()")
        pieces = _pieces(optimizer, units)
        on_disk = {id(p) for _, params in pieces for p in params}
        self.store(optimizer).step(optimizer, pieces, lambda: own_step(optimizer))
        stand_in = object.__new__(type(optimizer))  # the same attributes and state, and groups
        stand_in.__dict__.update(optimizer.__dict__)  # of the rest of the parameters
        stand_in.param_groups = [{**g, "params": [p for p in g["params"] if id(p) not in on_disk]}
                                 for g in optimizer.param_groups]
        return (stand_in, *args[1:]), kwargs

    @contextlib.contextmanager
    def resident(self, optimizer, units: list):
        """All the state of ``units`` in ``optimizer`` in memory for the duration, then back in
        its files: for ``zero.save`` (which reads it) and ``zero.load`` (which replaces it).
        Nothing else reads an optimizer's state between steps; while it is on disk
        ``optimizer.state`` holds none of it."""
        store = self.store(optimizer)  # (an optimizer that never stepped has it made here)
        store.pieces = _pieces(optimizer, units)
        for unit, params in store.pieces:
            store.put_back(optimizer, unit, params, store.read(unit))
        lent = {id(v) for v in _state_values(optimizer, store.pieces)}
        try:
            yield
        except BaseException:
            store.store_all(optimizer)
            raise
        # A load replaced the state: every unit is at the checkpoint's step again.
        if any(id(v) not in lent for v in _state_values(optimizer, store.pieces)):
            store.failed = None
        store.store_all(optimizer)
        if store.failed is not None:  # a save (a read) of units stepped a different number of times
            raise RuntimeError(
                f"the last opt.step() failed part way under DiskOffload (an exception, or "
                f"Ctrl-C): the units before {store.failed.name} were stepped, that one and the "
                "rest were not, so a checkpoint now would hold units at different steps. Save "
                "before opt.step(), or resume from the last checkpoint (zero.load(path, model, "
                "opt)), which clears this")


def stores_of(optimizer) -> list["StateStore"]:
    return list(optimizer.__dict__.get("_zero_disk_stores", {}).values())


class StateStore:
    """One optimizer's state for the units of one ``DiskOffload``, in one file per unit.

    A unit's state is one byte buffer, the tensors of its parameters' state end to end (each
    at a multiple of ``ALIGN``); its index (which parameter, key, dtype, shape, where) stays in
    memory with the scalar state (AdamW's ``step``, a 0-d tensor), which is too small to move.
    Everything is keyed by the unit object (its name is only for the ledger).
    """

    def __init__(self, directory: str):
        self.disk = StateFiles(directory)  # checked writes and reads (zero/features/disk_files.py)
        self.root = self.disk.root
        self.unwritten: dict = {}  # unit -> its buffer, whose write the disk refused
        self.index: dict = {}  # unit -> [(param, key, dtype, shape, offset)]
        self.sizes: dict = {}  # unit -> its buffer's bytes
        self.files: dict = {}  # unit -> its file's number
        self.scalars: dict = {}  # param -> {key: value} kept in memory
        self.pieces: list[tuple] = []  # (unit, its parameters), the last step's
        self.failed = None  # the unit at which the last step raised
        self.held_bytes = self.peak_bytes = 0
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="zero-disk")

    def _submit(self, fn, *args):
        """``fn(*args)`` on the I/O thread, in a copy of this thread's context (the active
        ledgers, which record its reads and writes)."""
        return self._io.submit(contextvars.copy_context().run, fn, *args)

    def path(self, unit) -> str:
        number = self.files.setdefault(unit, len(self.files))
        return os.path.join(self.root, f"unit{number:05d}.state")

    def _hold(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    # ---- one unit's state, between its file and the optimizer -------------------------------

    def read(self, unit) -> torch.Tensor | None:
        """Unit ``unit``'s state buffer from its file (None before its first step)."""
        size = self.sizes.get(unit)
        if size is None:
            return None
        buf = torch.empty(size, dtype=torch.uint8)
        self._hold(size)
        self.disk.read_into(self.path(unit), buf.numpy())  # its length and CRC checked
        ledger.record_copy("read", buf, unit.name, "step")
        return buf

    def put_back(self, optimizer, unit, params: list, buf: torch.Tensor | None) -> None:
        """Give the optimizer the unit's state, as views into ``buf``."""
        for p, key, dtype, shape, offset in self.index.get(unit, ()):
            assert buf is not None  # (a unit with state in its index has a file)
            nbytes = shape.numel() * dtype.itemsize
            optimizer.state[p][key] = buf[offset:offset + nbytes].view(dtype).view(shape)
        for p in params:
            if self.scalars.get(p):
                optimizer.state[p].update(self.scalars[p])

    def take_out(self, optimizer, unit, params: list, buf: torch.Tensor | None):
        """Take the unit's state out of the optimizer, into ``buf``; returns the buffer to
        write. The layout follows the state: without a buffer (the first step, a load), and
        whenever the optimizer made state for another parameter (one unused until now) or
        changed a tensor's dtype or shape, the unit gets a new buffer."""
        entries = [(p, key, v.dtype, v.shape) for p in params
                   for key, v in optimizer.state.get(p, {}).items() if _moved(v)]
        same = lambda es: [(id(p), *rest) for p, *rest in es]  # noqa: E731 (not tensor ==)
        if buf is None or same(entries) != same(e[:4] for e in self.index.get(unit, ())):
            if buf is not None:
                self._hold(-buf.numel())  # (the old layout's buffer goes once this returns)
            index, offset = [], 0
            for p, key, dtype, shape in entries:
                index.append((p, key, dtype, shape, offset))
                offset += -(-shape.numel() * dtype.itemsize // ALIGN) * ALIGN
            self.index[unit], self.sizes[unit] = index, offset
            self._hold(offset)  # (the optimizer's new tensors are copied in, then dropped)
            buf = torch.empty(offset, dtype=torch.uint8)
        for p, key, dtype, shape, offset in self.index[unit]:
            value = optimizer.state[p][key]
            view = buf[offset:offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            if value.data_ptr() != view.data_ptr():  # (new or replaced, not updated in place)
                view.copy_(value)
        for p in params:
            state = optimizer.state.pop(p, {})
            self.scalars[p] = {k: v for k, v in state.items() if not _moved(v)}
        return buf

    def write(self, unit, buf: torch.Tensor) -> None:
        """Write the unit's buffer to its file; it is freed once written. One the disk refuses
        is kept (``unwritten``), for the step to give back to the optimizer."""
        try:
            self.disk.write(self.path(unit), buf.numpy())
        except StateFileError:
            self.unwritten[unit] = buf
            raise
        finally:
            self._hold(-buf.numel())
        ledger.record_copy("write", buf, unit.name, "step")

    def _keep_unwritten(self, optimizer, pieces: list) -> int:
        """The units whose write failed: their state back in ``optimizer.state`` (in memory,
        as without disk offload), and no file of theirs is read again. How many there were;
        the store then holds nothing in memory (as between steps)."""
        kept = 0
        for unit, params in pieces:
            buf = self.unwritten.pop(unit, None)
            if buf is not None:
                self.put_back(optimizer, unit, params, buf)
                self.index.pop(unit, None)
                self.sizes.pop(unit, None)
                kept += 1
        self.held_bytes = 0
        return kept

    # ---- the whole step, and the whole state for a checkpoint -------------------------------

    def step(self, optimizer, pieces: list[tuple], own_step) -> None:
        """``own_step()`` once per unit, over ``pieces`` (unit, its parameters in the
        optimizer) in order, each unit's state read before and written after, one ahead."""
        if self.failed is not None:
            raise RuntimeError(
                f"the last opt.step() failed part way under DiskOffload: the units before "
                f"{self.failed.name} were stepped (their state is written), that one and the rest "
                "were not. Stepping again would step the first ones twice: resume from a "
                "checkpoint (zero.load(path, model, opt)), which clears this")
        self.pieces = pieces
        ahead = self._submit(self.read, pieces[0][0]) if pieces else None
        writes, current, refused = [], [], []
        try:
            for k, (unit, params) in enumerate(pieces):
                self.failed = unit  # (until its state is taken out again)
                assert ahead is not None  # (pieces is not empty here)
                buf, current = ahead.result(), params
                if k + 1 < len(pieces):  # the next unit's read overlaps this unit's step
                    ahead = self._submit(self.read, pieces[k + 1][0])
                self.put_back(optimizer, unit, params, buf)
                with only(optimizer, params):
                    own_step()
                buf = self.take_out(optimizer, unit, params, buf)
                current, self.failed = [], None
                writes.append(self._submit(self.write, unit, buf))
                del buf
        finally:
            for w in writes:  # every unit on disk again before the step returns
                try:
                    w.result()
                except StateFileError as e:
                    refused.append(e)
            if ahead is not None:
                ahead.result()
            for p in current:  # a step that raised: the unit's file holds its state before it
                optimizer.state.pop(p, None)
            kept = self._keep_unwritten(optimizer, pieces)
        if refused:
            raise StateFileError(
                f"{refused[0]}. This step is complete, and the state of the {kept} unit(s) "
                "the disk refused is kept in memory (optimizer.state): free space or raise the "
                "limit, and the next step writes it again; or save a checkpoint now "
                "(zero.save)") from refused[0]

    def store_all(self, optimizer) -> None:
        """Every unit's state from the optimizer to its file again (after ``resident`` put it
        there, and a load may have replaced all of it)."""
        refused = None
        for unit, params in self.pieces:
            if any(p in optimizer.state for p in params):
                try:
                    self.write(unit, self.take_out(optimizer, unit, params, None))
                except StateFileError as e:
                    refused = refused or e
            else:  # the unit has no state (a load gave it none): as in memory, it starts afresh
                self.index.pop(unit, None)
                if self.sizes.pop(unit, None) is not None:
                    self.disk.remove(self.path(unit))
                for p in params:
                    self.scalars.pop(p, None)
        self._keep_unwritten(optimizer, self.pieces)
        if refused is not None:
            raise StateFileError(f"{refused}; that state is kept in memory "
                                 "(optimizer.state)") from refused


def _pieces(optimizer, units: list) -> list[tuple]:
    """[(unit, its parameters in the optimizer)] for ``units``, in the order of the
    optimizer's parameters (the same on every rank)."""
    wanted = set(units)
    out: dict = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = registry.unit_of(p)
            if unit in wanted:
                out.setdefault(unit, []).append(p)
    return list(out.items())


def _state_values(optimizer, pieces: list):
    """Every state value of the parameters in ``pieces`` (to tell whether a load replaced them)."""
    return [v for _, params in pieces for p in params
            for v in optimizer.state.get(p, {}).values()]


def _moved(value) -> bool:
    """Whether a state value goes to disk: a tensor with elements (not AdamW's 0-d step)."""
    return torch.is_tensor(value) and value.dim() > 0


@contextlib.contextmanager
def only(optimizer, params: list):
    """The optimizer's groups hold only ``params`` for the duration (always restored)."""
    keep, saved = {id(p) for p in params}, [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = [p for p in g["params"] if id(p) in keep]
    try:
        yield
    finally:
        for g, params_of_group in zip(optimizer.param_groups, saved):
            g["params"] = params_of_group
