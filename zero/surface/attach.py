"""What zero does about the code around the units: optimizers, state dicts, old parameters.

Whatever still reaches the replaced parameters, or reads the 1-D pieces as if they were whole, would
compute silently wrong results; each way in gets a hook that does the right thing or raises, naming
the fix: an optimizer over the pieces (notes/03-stage1.md, "Hooks on the optimizer"), the original
parameters and ``module.state_dict()`` (notes/13-agreement.md, "zero_grad, state_dict, buffers"),
``load_state_dict(sd, assign=True)`` (the units adopt the new parameters: notes/18-edge-cases.md).

[Note: finding the optimizers] torch gives no hook for an optimizer being built, so zero learns of
one at its first step: the first ``zero.shard`` of a process registers torch's global step pre-hook
(``watch``), which attaches zero's two hooks to each optimizer over its pieces. Why one a process,
holding no model: notes/15-where-ideas-go.md, "What does not go through the backend".
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zero import comm
from zero.core import adoption, registry
from zero.core.guards import state_dict_access_granted
from zero.core.optimizers import NO_LAYOUT, WHOLE_TENSOR, ELEMENTWISE


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
    """The state-dict hooks, on every module that holds a sharded parameter."""
    for module in modules:
        if not getattr(module, "_zero_state_dict_hooks", False):
            module.register_state_dict_pre_hook(_state_dict_pre_hook)
            module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
            module.register_load_state_dict_post_hook(_adopt_after_load)
            setattr(module, "_zero_state_dict_hooks", True)


def watch() -> None:
    """Listen for the first step of the optimizers over zero's units, once a process (the note)."""
    marked = torch_optimizer  # (zero's mark on torch's module, beside the hooks it keeps)
    if not getattr(marked, "_zero_watching", False):
        register_optimizer_step_pre_hook(discover)
        setattr(marked, "_zero_watching", True)


def discover(optimizer, args, kwargs) -> None:
    """torch's global step pre-hook (``serve``)."""
    serve(optimizer)
    return None


def serve(optimizer) -> None:
    """Attach zero's two hooks to ``optimizer`` if it holds zero's pieces (once per group added)."""
    seen = optimizer.__dict__.get("_zero_seen")
    if seen is not None and seen[0] == len(optimizer.param_groups):
        return
    attached = seen is not None and seen[1]
    if not attached and units_of_optimizer(optimizer):
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)
        attached = True
    optimizer._zero_seen = (len(optimizer.param_groups), attached)


def units_of_optimizer(optimizer) -> list:
    units: dict = {}  # ordered, deduplicated: the same order on every rank
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


def _before_step(optimizer, args, kwargs):
    """zero's step pre-hook on ``optimizer``, the last of its pre-hooks."""
    units = units_of_optimizer(optimizer)
    if units:
        _refuse_whole_tensor_optimizers(optimizer, units)
        _guard_state_dicts(optimizer, units)
    for unit in units:
        unit.wait_unshard()  # an in-place gather may still read the shard the step writes
    policies = _by_policy(units)
    changed = None
    for policy, its_units in policies.items():
        out = policy.before_step(optimizer, its_units, args, kwargs)
        if out is not None and changed is not None:
            raise ValueError(f"one optimizer over units of two offload policies that each step "
                             f"it their own way ({len(policies)} policies): give all its units "
                             "one offload policy")
        changed = out if out is not None else changed
    if changed is not None:  # a policy stepped itself: with the settings it saw (_after_step)
        optimizer._zero_step_settings = _settings(optimizer)
    return changed


def _by_policy(units: list) -> dict:
    """Each offload policy, with its units, in the units' order."""
    policies: dict = {}
    for unit in units:
        policies.setdefault(unit.offload, []).append(unit)
    return policies


def _settings(optimizer) -> list[str]:
    """The optimizer's settings (each parameter group's, but its parameters), as text."""
    return [repr({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


# [Note: an optimizer's state dict] It holds this rank's pieces by position, which DCP would take
# for replicated state: from its first step over pieces on, its state_dict() and load_state_dict()
# raise, naming the fix (layout "rows": FSDP2's DTensors, which work). State loaded before the
# first step is checked then: every elementwise state must have its piece's shape.


def _guard_state_dicts(optimizer, units) -> None:
    if getattr(optimizer, "_zero_state_dicts_guarded", False):
        return
    if all(u.layout.exposes_dtensors for u in units):  # FSDP2's: DTensors, nothing to guard
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
    if not state_dict_access_granted():
        raise RuntimeError(
            "optimizer.state_dict() of an optimizer over zero's pieces holds this rank's 1-D "
            "pieces of each parameter's state, by position: DCP would keep one rank's as if "
            "they were replicated, and another rank loading them would resume with this one's. "
            "Use zero.save(path, model, opt) (or zero.checkpoint.state_dict(model, opt), "
            "FSDP2's layout, for DCP), or shard with layout='rows', whose state is FSDP2's")


def _optimizer_load_state_dict_pre_hook(optimizer, state_dict):
    if not state_dict_access_granted():
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
    piecewise = sorted({u.layout.name for u in units if not u.layout.whole_parameters})
    if kind in WHOLE_TENSOR and piecewise:
        raise RuntimeError(
            f"torch.optim.{kind} reads each parameter whole ({WHOLE_TENSOR[kind]}), but "
            f"layout={piecewise[0]!r} gives it only this rank's part of each one: it would compute "
            "something else, silently. Shard with zero.shard(..., layout='whole'): each parameter "
            "then lives whole on one rank, and that rank's optimizer sees it in its own shape")


def _after_step(optimizer, args, kwargs) -> None:
    """The policies' part after the step; then every unit stepped, even one with no element here."""
    units = units_of_optimizer(optimizer)
    settings = optimizer.__dict__.pop("_zero_step_settings", None)
    if settings is not None and settings != _settings(optimizer):
        raise RuntimeError(
            "a step pre-hook registered on this optimizer after its first step changed its "
            "settings (lr, ...) after zero's offload policy had already stepped with the old "
            "ones: register step pre-hooks before the first opt.step()")
    for policy, its_units in _by_policy(units).items():
        policy.after_step(optimizer, its_units)
    for unit in units:
        unit.mark_stepped()


def _shows_dtensors(module) -> bool:
    """Whether ``module``'s sharded parameters are FSDP2's DTensors (layout "rows")."""
    units = {registry.unit_of(p) for p in module._parameters.values()} | set(
        registry.units_on(module))
    units.discard(None)
    return bool(units) and all(u.layout.exposes_dtensors for u in units)


def _state_dict_pre_hook(module, prefix, keep_vars) -> None:
    if not state_dict_access_granted() and not _shows_dtensors(module):
        raise RuntimeError(
            "state_dict() of a module sharded by zero would hold this rank's 1-D pieces of "
            "each parameter under the full names. Use zero.full_state_dict(model) for full "
            "tensors (call it on every rank), or zero.save(path, model, opt) for a sharded "
            "checkpoint, or shard with layout='rows', whose parameters are FSDP2's DTensors")


def _adopt_after_load(module, incompatible_keys) -> None:
    """After ``load_state_dict(sd, assign=True)``, once the ranks agree, the units adopt."""
    units = registry.units_on(module)
    if units and not state_dict_access_granted():  # (zero's own loads put views there)
        comm.agree(f"adopt what load_state_dict put in {type(module).__name__}"
                   f"{adoption.pending(units)}", group=units[0].all_group,
                   ctx=units[0].root.context,
                   fix="Call load_state_dict on every rank, with the same kind of values "
                       "(assign=True everywhere, or nowhere), so that every rank adopts the "
                       "same parameters")
        for unit in units:
            unit.adopt_replaced()


def _load_state_dict_pre_hook(module, state_dict, prefix, *args) -> None:
    if not state_dict_access_granted() and not _shows_dtensors(module):
        raise RuntimeError(
            "load_state_dict() on a module sharded by zero would copy full tensors into this "
            "rank's 1-D pieces. Use zero.load_full_state_dict(model, state) for a full state "
            "dict (on every rank), or zero.load(path, model, opt) for a zero.save checkpoint")
