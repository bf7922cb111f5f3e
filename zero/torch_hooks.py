"""What zero does about the code around the units: optimizers, state dicts, old parameters.

Sharding replaces each parameter by this rank's 1-D piece of it. Whatever still reaches
the old tensors, or reads the pieces as if they were whole, would compute silently wrong
results; each way in gets a hook that either does the right thing or raises, naming the fix:

- an optimizer: a global step pre-hook waits for any all-gather still reading the shard
  the step is about to write, and refuses the replaced originals (built before sharding);
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

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zero.core import registry

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


def _before_step(optimizer, args, kwargs) -> None:
    for unit in units_of_optimizer(optimizer):
        unit.wait_unshard()  # an in-place gather may still read the shard the step writes


@contextlib.contextmanager
def state_dict_access():
    """For zero's own helpers, which put full tensors in place before calling state_dict."""
    _state["state_dict_access"] += 1
    try:
        yield
    finally:
        _state["state_dict_access"] -= 1


def _state_dict_pre_hook(module, prefix, keep_vars) -> None:
    if not _state["state_dict_access"]:
        raise RuntimeError(
            "state_dict() of a module sharded by zero would hold this rank's 1-D pieces of "
            "each parameter under the full names. Use zero.full_state_dict(model) for full "
            "tensors (call it on every rank), or zero.save(path, model, opt) for a sharded "
            "checkpoint")


def _load_state_dict_pre_hook(module, state_dict, prefix, *args) -> None:
    if not _state["state_dict_access"]:
        raise RuntimeError(
            "load_state_dict() on a module sharded by zero would copy full tensors into this "
            "rank's 1-D pieces. Use zero.load_full_state_dict(model, state) for a full state "
            "dict (on every rank), or zero.load(path, model, opt) for a zero.save checkpoint")
