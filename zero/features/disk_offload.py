"""Disk offload (ZeRO-Infinity's NVMe tier, on any file system): the optimizer state in files.

ZeRO-Infinity (Rajbhandari et al., SC21) goes a tier past ZeRO-Offload (``offload.py``): one file
of optimizer state per unit, at most two units' in memory; the step split unit by unit
(``before_step``), bitwise the in-memory run for optimizers that update each parameter alone
(``ELEMENTWISE``). notes/17-family.md, "Disk offload", draws the loop.
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
        """Step ``units`` one by one; the call's arguments, a stand-in optimizer for the rest."""
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
        """All the state of ``units`` in memory for the duration (save, load), then in its files."""
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
    """[(unit, its parameters in the optimizer)] for ``units``, in the optimizer's order."""
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
    return [v for _, params in pieces for p in params for v in optimizer.state.get(p, {}).values()]
