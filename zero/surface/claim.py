"""Which parameters a ``zero.shard`` call claims for its unit, and what it refuses to claim.

Local to a rank: ``zero.shard`` runs it inside ``comm.raising_together``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero.core import registry
from zero.core.registry import units_on
from zero.core.stage import STAGES
from zero.surface.policies import MixedPrecision


def claim(modules: list[nn.Module], stage: int, mp_policy, reshard_after_forward, ignored):
    """The local checks; returns the unit's parameters, their uses, and the units below."""
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3 (ZeRO's three stages), got {stage!r}")
    if reshard_after_forward is not None and stage != 3:
        raise ValueError("reshard_after_forward only applies to stage 3; leave it None")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise TypeError("mp_policy must be a zero.MixedPrecision or torch's MixedPrecisionPolicy")
    for module in modules:
        if registry.unit_on(module) is not None:
            raise RuntimeError(
                f"{type(module).__name__} is already sharded; call zero.shard once per module")

    children = list({u: None for top in modules for m in top.modules() for u in units_on(m)})
    for child in children:
        if child.stage != stage:
            raise ValueError(
                f"{child.name} is a stage-{child.stage} unit but this call asks "
                f"for stage {stage}; use one stage for all units of a model")
    params, locations = _own_parameters(modules, children, ignored)
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        names = {str(d): [n for n, p in named(modules, params) if p.dtype == d] for d in dtypes}
        raise ValueError(
            f"one unit needs one dtype, but {type(modules[0]).__name__}'s parameters have "
            f"{names}; cast the module (module.to(dtype)) or shard the differing sub-modules "
            "as their own units first")
    return params, locations, children


def device_of(module: nn.Module, device, default) -> torch.device:
    """Where the unit computes: where ``module`` is, or on meta ``device`` (or ``default``)."""
    found = next(iter([*module.parameters(), *module.buffers()]), None)
    if found is not None and found.device.type != "meta":
        if device is not None and torch.device(device) != found.device:
            raise ValueError(f"device={device} but the module is on {found.device}; move the "
                             "module first, or build it on the meta device")
        return found.device
    return torch.device(device) if device is not None else default


def _own_parameters(modules: list[nn.Module], children: list, ignored: set[int]):
    """The parameters this unit takes (not owned below, not ignored), each with its every use."""
    inside = {u: {id(m) for top in u.modules for m in top.modules()} for u in children}
    found: dict[int, tuple[nn.Parameter, list]] = {}
    for top in modules:
        for mod_name, mod in top.named_modules():
            for attr, p in mod._parameters.items():
                if p is None or id(p) in ignored or registry.is_ignored(p):
                    continue
                owner = registry.unit_of(p)
                if registry.replaced_by(p) is not None:  # tied to a unit's original
                    raise _shared_error(f"{mod_name}.{attr}", registry.replaced_by(p))
                if owner is None:
                    found.setdefault(id(p), (p, []))[1].append((mod, attr))
                elif owner not in inside:
                    raise RuntimeError(
                        f"'{mod_name}.{attr}' already belongs to a unit above "
                        f"{type(top).__name__}: zero.shard was called on a parent before this "
                        "child. Shard bottom-up: children first, then their parents")
                elif id(mod) not in inside[owner]:
                    raise _shared_error(f"{mod_name}.{attr}", owner)
    params = [p for p, _ in found.values()]
    return params, [locs for _, locs in found.values()]


def _shared_error(name: str, owner) -> ValueError:
    return ValueError(
        f"parameter '{name}' is shared with the unit {owner.name}, which "
        "does not contain this use of it. A shared (tied) parameter must live in one unit: "
        "do not shard a module holding only some of its users; shard a common parent instead")


def named(modules: list[nn.Module], params) -> list[tuple[str, nn.Parameter]]:
    """``params`` with their names in ``modules`` ("0.weight": the first of a list)."""
    ids = {id(p) for p in params}
    prefix = len(modules) > 1  # "0.weight", "1.weight": which module of the list
    return [(f"{i}.{n}" if prefix else n, p) for i, m in enumerate(modules)
            for n, p in m.named_parameters() if id(p) in ids]
