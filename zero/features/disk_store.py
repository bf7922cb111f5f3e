"""Disk offload's store: one optimizer's state in files, one a unit, moved around its step.

``DiskOffload`` decides when a unit's state is needed; this reads it ahead of the unit's step
and writes it back after, in the background, each file checked (``disk_files.py``); a write the
disk refuses leaves that unit's state in ``optimizer.state``, and says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from zero.comm import ledger
from zero.features.disk_files import StateFileError, StateFiles

ALIGN = 64  # bytes: every state tensor starts at a multiple of this in its unit's buffer


class StateStore:
    """One optimizer's state for a ``DiskOffload``'s units, a file a unit (notes/17-family.md)."""

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
        """``fn(*args)`` on the I/O thread, in this thread's context (its ledgers)."""
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
        """The unit's state out of the optimizer, into ``buf`` (new if none or a new layout)."""
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
        """Write the unit's buffer to its file; one the disk refuses is kept (``unwritten``)."""
        try:
            self.disk.write(self.path(unit), buf.numpy())
        except StateFileError:
            self.unwritten[unit] = buf
            raise
        finally:
            self._hold(-buf.numel())
        ledger.record_copy("write", buf, unit.name, "step")

    def _keep_unwritten(self, optimizer, pieces: list) -> int:
        """The units whose write failed: state back in ``optimizer.state``; returns how many."""
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
        """``own_step()`` once per unit of ``pieces`` in order, its state read one ahead."""
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
        """Every unit's state from the optimizer to its file again (after ``resident``)."""
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
