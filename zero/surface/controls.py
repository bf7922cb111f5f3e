"""FSDP2's controls, with FSDP2's names and meaning: functions of the sharded module.

The module is the first argument (FSDP2's ``model.unshard()`` is ``zero.unshard(model)``: zero
keeps your module's class); ``no_sync`` is DDP's. On purpose, our ``unshard()`` also *pins* the
unit: forwards (evaluation, generation) gather nothing until ``reshard``, but once after a step.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from zero.core import registry


def _unit(module: nn.Module):
    unit = registry.unit_on(module)
    if unit is None:
        raise ValueError(f"{type(module).__name__} is not a unit: call zero.shard on it first "
                         "(these controls act on the module zero.shard was given)")
    return unit


def _units(module: nn.Module, recurse: bool) -> list:
    _unit(module)
    return registry.units_of(module) if recurse else registry.units_on(module)


class UnshardHandle:
    """What ``unshard(module, async_op=True)`` returns: ``wait()`` ends the gather."""

    def __init__(self, units):
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            unit.wait_unshard()


def unshard(module: nn.Module, async_op: bool = False) -> UnshardHandle | None:
    """Gather ``module``'s unit (not the units below it, as in FSDP2) and keep it gathered
    until ``reshard(module)``. With ``async_op`` the gather is started and a handle returned."""
    units = _units(module, recurse=False)
    for unit in units:
        unit.controls.pinned = True
        unit.unshard(phase="other", async_op=True)
    handle = UnshardHandle(units)
    if async_op:
        return handle
    handle.wait()
    return None


def reshard(module: nn.Module) -> None:
    """Unpin ``module``'s unit and, at stage 3, free its full parameters now."""
    for unit in _units(module, recurse=False):
        unit.controls.pinned = False
        unit.reshard()


def set_modules_to_forward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """When ``module``'s unit starts its forward, start gathering these units (in this order),
    instead of the one that ran next last iteration."""
    targets = [u for m in modules for u in _units(m, recurse=False)]
    for unit in _units(module, recurse=False):
        unit.controls.forward_prefetch = targets


def set_modules_to_backward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """When backward reaches ``module``'s unit, start gathering these units, instead of the
    one that ran before it in forward."""
    targets = [u for m in modules for u in _units(m, recurse=False)]
    for unit in _units(module, recurse=False):
        unit.controls.backward_prefetch = targets


def set_reshard_after_forward(module: nn.Module, reshard_after_forward: bool,
                              recurse: bool = True) -> None:
    """Stage 3: free the parameters after forward (True) or keep them for backward (False)."""
    for unit in _units(module, recurse):
        if not unit.set_reshard_after_forward(reshard_after_forward):
            raise ValueError("reshard_after_forward only applies to stage 3: stages 1 and 2 "
                             "always keep their full parameters")


def set_reshard_after_backward(module: nn.Module, reshard_after_backward: bool,
                               recurse: bool = True) -> None:
    """Stage 3: free the parameters after backward (True), or keep them gathered, so that the
    next micro-batch's forward needs no all-gather (False; set True for the last one)."""
    for unit in _units(module, recurse):
        unit.controls.reshard_after_backward = reshard_after_backward


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool,
                               recurse: bool = True) -> None:
    """Reduce gradients at the end of each backward (True), or accumulate them unsynced
    (False), as ``zero.no_sync`` does for the duration of a ``with`` block."""
    for unit in _units(module, recurse):
        unit.controls.requires_grad_sync = requires_gradient_sync


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients over micro-batches without communication (DDP's ``no_sync``): each
    unit's full flat gradient stays in place, and the first backward outside reduces it all;
    ``zero_grad()`` in between discards it, as with DDP."""
    units = registry.units_of(model)
    before = [u.controls.requires_grad_sync for u in units]
    for u in units:
        u.controls.requires_grad_sync = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u.controls.requires_grad_sync = b
