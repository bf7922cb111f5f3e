"""What zero does about the code around the units: optimizers, state dicts, old parameters.

Sharding replaces each parameter by this rank's 1-D piece of it. Whatever still reaches
the old tensors, or reads the pieces as if they were whole, would compute silently wrong
results; each way in gets a hook that either does the right thing or raises, naming the fix:

- an optimizer: a global step pre-hook waits for any all-gather still reading the shard
  the step is about to write, refuses the replaced originals (built before sharding) and an
  optimizer that would compute something else on the pieces a layout gives it; a post-hook
  marks the units it stepped, on every rank, even one that holds none of a unit's elements;
- the original parameters: a module outside the sharded model that shares one would train
  it on each rank alone; a gradient reaching an original raises;
- ``module.state_dict()`` / ``load_state_dict()``: on a sharded module they would give and
  take this rank's pieces under the full names (and rank 0's file would load, silently
  wrong, everywhere); they raise and point to ``zero.full_state_dict`` /
  ``zero.load_full_state_dict`` and ``zero.save`` / ``zero.load``.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from zero.core import registry
from zero import disk_offload

_state = {"optimizer_hook": False, "state_dict_access": 0}


def replace(params, unit, names) -> None:
    """Mark the replaced originals: whoever still holds one is out of date."""
    name_of = {id(p): n for n, p in names}
    for orig in params:
        registry.mark_replaced(orig, unit)
        if orig.requires_grad:
            orig.register_hook(partial(_outside_use, name_of.get(id(orig), "?"), unit))


def _outside_use(name: str, unit, grad):
    raise RuntimeError(
        f"a gradient reached parameter '{name}' as it was before zero.shard replaced it by its "
        f"shard in unit {unit.name}: something outside the sharded model still computes with "
        "it (a module outside that shares it?), and would train it on each rank alone. Shard a "
        "module that contains every user of the parameter")


def install(modules: list[nn.Module]) -> None:
    """The hooks, on every module that holds a sharded parameter (and the unit's own)."""
    if not _state["optimizer_hook"]:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _state["optimizer_hook"] = True
    for module in modules:
        if not getattr(module, "_zero_state_dict_hooks", False):
            module.register_state_dict_pre_hook(_state_dict_pre_hook)
            module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
            module._zero_state_dict_hooks = True


def units_of_optimizer(optimizer) -> list:
    units = {}  # ordered, deduplicated: the same order on every rank
    for group in optimizer.param_groups:
        for p in group["params"]:
            if registry.replaced_by(p) is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter that zero.shard replaced by "
                    "its shard: the optimizer was built before sharding. Build it after "
                    "zero.shard, from model.parameters(). (Or it was given the parameters of a "
                    "module outside the sharded model that shares them: shard a module that "
                    "contains every user of a shared parameter)")
            unit = registry.unit_of(p)
            if unit is not None:
                units[unit] = None
    return list(units)


# Optimizers that read a parameter as a whole: on a piece of it (flat) or on some of its rows
# (rows) they compute something else, silently. (LBFGS reads all parameters as one vector and
# takes dot products over it: on any rank's share of them it is wrong under every layout.)
WHOLE_TENSOR = {"Adafactor": "its factored second moment is per row and column of a matrix",
                "Muon": "it orthogonalises the update of each whole matrix"}
NO_LAYOUT = {"LBFGS": "it takes dot products over all parameters as one vector, and each rank "
                      "holds only its share"}


def _before_step(optimizer, args, kwargs):
    units = units_of_optimizer(optimizer)
    if units:
        _refuse_whole_tensor_optimizers(optimizer, units)
        _guard_state_dicts(optimizer, units)
    for unit in units:
        unit.wait_unshard()  # an in-place gather may still read the shard the step writes
    if any(isinstance(u.offload, disk_offload.DiskOffload) for u in units):
        return _step_from_disk(optimizer, args, kwargs)
    return None


def _step_from_disk(optimizer, args, kwargs):
    """Disk offload (``zero/disk_offload.py``): step unit by unit, each unit's state read from
    its file and written back; the call itself then runs on a stand-in that holds only the
    parameters of no such unit (what the hook returns is the call's arguments)."""
    kind = type(optimizer).__name__
    own_step = getattr(type(optimizer).step, "__wrapped__", None)
    if kind not in ELEMENTWISE or own_step is None:
        raise RuntimeError(
            f"DiskOffload steps the optimizer unit by unit, which computes what one step does "
            f"only for an optimizer that updates each parameter on its own; {kind} is not one "
            f"zero knows ({sorted(ELEMENTWISE)}). Use CPUOffload with it")
    if len(args) > 1 or kwargs:
        raise ValueError(
            "opt.step(closure) (or with other arguments) under DiskOffload: the step runs once "
            "per unit, and a closure would be evaluated each time. Compute the loss and "
            "backward first, then call opt.step()")
    by_policy = disk_offload.pieces_of(optimizer)
    if len(by_policy) > 1:
        raise ValueError(f"one optimizer over units with different DiskOffload policies "
                         f"({len(by_policy)} directories): give them all one DiskOffload")
    (policy, pieces), = by_policy.items()
    on_disk = {id(p) for _, params in pieces for p in params}
    policy.store(optimizer).step(optimizer, pieces, lambda: own_step(optimizer))
    stand_in = object.__new__(type(optimizer))  # the same attributes and state, and groups of
    stand_in.__dict__.update(optimizer.__dict__)  # the rest of the parameters
    stand_in.param_groups = [{**g, "params": [p for p in g["params"] if id(p) not in on_disk]}
                             for g in optimizer.param_groups]
    return (stand_in, *args[1:]), kwargs


# [Note: an optimizer's state dict] torch's optimizer.state_dict() holds each parameter's
# state by position, and here each parameter is this rank's piece: DCP, given it under the
# same keys on every rank, takes the pieces for replicated copies and keeps one rank's, and a
# state dict saved on rank 0 and loaded everywhere (DDP's habit) resumes every rank with rank
# 0's moments. So from an optimizer's first step over pieces on, its state_dict() and
# load_state_dict() raise, naming what does it right; with layout "rows" the state is FSDP2's
# (DTensors), which DCP handles, and they work. State loaded before the first step is checked
# at that step: every elementwise state (exp_avg...) must have its piece's shape.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
               "Adadelta", "ASGD"}


def _guard_state_dicts(optimizer, units) -> None:
    if getattr(optimizer, "_zero_state_dicts_guarded", False):
        return
    if all(u.layout.name == "rows" for u in units):  # FSDP2's layout: DTensors, nothing to guard
        optimizer._zero_state_dicts_guarded = True
        return
    if type(optimizer).__name__ in ELEMENTWISE:
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            for key, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() and v.shape != p.shape:
                    raise RuntimeError(
                        f"{type(optimizer).__name__}'s state {key!r} of a parameter has shape "
                        f"{tuple(v.shape)} but the parameter is this rank's piece, "
                        f"{tuple(p.shape)}: a state dict of whole tensors (DDP's), or of another "
                        "rank's pieces, was loaded into it. Resume with zero.load(path, model, "
                        "opt) from a zero.save checkpoint")
    optimizer.register_state_dict_pre_hook(_optimizer_state_dict_pre_hook)
    optimizer.register_load_state_dict_pre_hook(_optimizer_load_state_dict_pre_hook)
    optimizer._zero_state_dicts_guarded = True


def _optimizer_state_dict_pre_hook(optimizer) -> None:
    if not _state["state_dict_access"]:
        raise RuntimeError(
            "optimizer.state_dict() of an optimizer over zero's pieces holds this rank's 1-D "
            "pieces of each parameter's state, by position: DCP would keep one rank's as if "
            "they were replicated, and another rank loading them would resume with this one's. "
            "Use zero.save(path, model, opt) (or zero.checkpoint.state_dict(model, opt), "
            "FSDP2's layout, for DCP), or shard with layout='rows', whose state is FSDP2's")


def _optimizer_load_state_dict_pre_hook(optimizer, state_dict):
    if not _state["state_dict_access"]:
        raise RuntimeError(
            "optimizer.load_state_dict() into an optimizer over zero's pieces would give each "
            "rank whatever pieces the dict holds (rank 0's, or whole tensors). Use "
            "zero.load(path, model, opt) from a zero.save checkpoint")
    return None


def _refuse_whole_tensor_optimizers(optimizer, units) -> None:
    kind = type(optimizer).__name__
    if kind in NO_LAYOUT:
        raise RuntimeError(f"torch.optim.{kind} cannot train a model sharded by zero: "
                           f"{NO_LAYOUT[kind]}. Use an optimizer that updates each parameter "
                           "on its own (AdamW, SGD, ...)")
    piecewise = sorted({u.layout.name for u in units if u.layout.name != "whole"})
    if kind in WHOLE_TENSOR and piecewise:
        raise RuntimeError(
            f"torch.optim.{kind} reads each parameter whole ({WHOLE_TENSOR[kind]}), but "
            f"layout={piecewise[0]!r} gives it only this rank's part of each one: it would "
            "compute something else, silently. Shard with zero.shard(..., layout='whole'): "
            "each parameter then lives whole on one rank, and that rank's optimizer sees it "
            "in its own shape")


def _after_step(optimizer, args, kwargs) -> None:
    """Mark every unit with a parameter in ``optimizer`` as stepped: the next forward refreshes
    it on every rank, whether or not this rank holds any of its elements (``whole``)."""
    for unit in units_of_optimizer(optimizer):
        if unit.unsharded.requires_grad:  # (frozen units are never stepped)
            unit.stepped = True


@contextlib.contextmanager
def state_dict_access():
    """For zero's own helpers, which put full tensors in place before calling state_dict."""
    _state["state_dict_access"] += 1
    try:
        yield
    finally:
        _state["state_dict_access"] -= 1


def _shows_dtensors(module) -> bool:
    """Whether ``module``'s sharded parameters are DTensors of their full shape (layout
    "rows", FSDP2's): its state dict is then FSDP2's, which DCP reads right."""
    units = {registry.unit_of(p) for p in module._parameters.values()} | set(
        registry.units_on(module))
    units.discard(None)
    return bool(units) and all(u.layout.name == "rows" for u in units)


def _state_dict_pre_hook(module, prefix, keep_vars) -> None:
    if not _state["state_dict_access"] and not _shows_dtensors(module):
        raise RuntimeError(
            "state_dict() of a module sharded by zero would hold this rank's 1-D pieces of "
            "each parameter under the full names. Use zero.full_state_dict(model) for full "
            "tensors (call it on every rank), or zero.save(path, model, opt) for a sharded "
            "checkpoint, or shard with layout='rows', whose parameters are FSDP2's DTensors")


def _load_state_dict_pre_hook(module, state_dict, prefix, *args) -> None:
    if not _state["state_dict_access"] and not _shows_dtensors(module):
        raise RuntimeError(
            "load_state_dict() on a module sharded by zero would copy full tensors into this "
            "rank's 1-D pieces. Use zero.load_full_state_dict(model, state) for a full state "
            "dict (on every rank), or zero.load(path, model, opt) for a zero.save checkpoint")
