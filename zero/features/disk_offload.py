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
import os
from dataclasses import dataclass, field

from zero import api
from zero.core import registry
from zero.core.optimizers import ELEMENTWISE
from zero.features.disk_store import StateStore
from zero.features.offload import CPUOffload


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

    def check(self, layout: type[api.Layout]) -> None:
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
