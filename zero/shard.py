"""``zero.shard``: turn a module into a unit, checking everything that could go wrong first.

Apply it bottom-up, like FSDP2's ``fully_shard``: each call makes one unit out of the
module's parameters that no unit below it owns yet::

    for block in model.blocks:
        zero.shard(block, stage=3)
    zero.shard(model, stage=3)   # the root: embeddings, final norm, head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # after sharding
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from zero import comm
from zero.mixed_precision import MixedPrecision
from zero.stage import STAGES
from zero.unit import Unit


def shard(
    module: nn.Module,
    *,
    stage: int = 3,
    group=None,
    mp_policy: MixedPrecision | None = None,
    reshard_after_forward: bool | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters across the ranks of ``group`` as one unit.

    Args:
        module: the module; its sub-modules already sharded stay their own units.
        stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters). All units of one
            model use one stage.
        group: the process group (default: the world).
        mp_policy: mixed precision (``zero.MixedPrecision``); None computes in the
            parameters' dtype.
        reshard_after_forward: stage 3 only. Free the parameters after forward and gather
            them again for backward (True), or keep them until the unit's backward is done
            (False: FSDP2's ZeRO-2-like mode). None: False for the root, True otherwise.
        device: where the shards live when ``module`` is on the meta device (default: the
            current accelerator for an accelerator backend, else the CPU); each rank then
            allocates only its own shards, and ``zero.init_parameters`` fills them.

    Returns:
        ``module``, whose parameters are now this rank's pieces (same names). Build the
        optimizer after this call.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3 (ZeRO's three stages), got {stage!r}")
    if reshard_after_forward is not None and stage != 3:
        raise ValueError("reshard_after_forward only applies to stage 3; leave it None")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise TypeError("mp_policy must be a zero.MixedPrecision")
    if getattr(module, "_zero_unit", None) is not None:
        raise RuntimeError(
            f"{type(module).__name__} is already sharded; call zero.shard once per module")

    children = [m._zero_unit for m in module.modules() if getattr(m, "_zero_unit", None)]
    for child in children:
        if child.stage.number != stage:
            raise ValueError(
                f"{type(child.module).__name__} is a stage-{child.stage.number} unit but this "
                f"call asks for stage {stage}; use one stage for all units of a model")
    params, locations = _own_parameters(module, children)
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        names = {str(d): [n for n, p in _names(module, params) if p.dtype == d] for d in dtypes}
        raise ValueError(
            f"one unit needs one dtype, but {type(module).__name__}'s parameters have "
            f"{names}; cast the module (module.to(dtype)) or shard the differing sub-modules "
            "as their own units first")

    device = _device(module, group, device)
    unit = Unit(module, params, locations, STAGES[stage], group, mp_policy,
                reshard_after_forward, device)
    _check_same_on_all_ranks(unit, module, params)
    for child in children:
        if child.parent is None:
            child.parent = unit
    for orig in params:
        orig._zero_replaced = unit  # whoever still holds it (an optimizer) is out of date
    unit.use_sharded_params()
    module._zero_unit = unit
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    _install_optimizer_hooks()
    return module


def _device(module: nn.Module, group, device) -> torch.device:
    found = next(iter([*module.parameters(), *module.buffers()]), None)
    if found is not None and found.device.type != "meta":
        if device is not None and torch.device(device) != found.device:
            raise ValueError(f"device={device} but the module is on {found.device}; move the "
                             "module first, or build it on the meta device")
        return found.device
    if device is not None:
        return torch.device(device)
    accelerator = torch.accelerator.current_accelerator()
    if dist.get_backend(group) in ("gloo", "fake") or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _own_parameters(module: nn.Module, children: list[Unit]):
    """The parameters this unit takes (not owned below), each with every place it is used."""
    inside = {u: {id(m) for m in u.module.modules()} for u in children}
    found: dict[int, tuple[nn.Parameter, list]] = {}
    for mod_name, mod in module.named_modules():
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            owner = getattr(p, "_zero_unit", None)
            if getattr(p, "_zero_replaced", None) is not None:  # tied to a unit's original
                raise _shared_error(f"{mod_name}.{attr}", p._zero_replaced)
            if owner is None:
                found.setdefault(id(p), (p, []))[1].append((mod, attr))
            elif owner not in inside:
                raise RuntimeError(
                    f"'{mod_name}.{attr}' already belongs to a unit above "
                    f"{type(module).__name__}: zero.shard was called on a parent before this "
                    "child. Shard bottom-up: children first, then their parents")
            elif id(mod) not in inside[owner]:
                raise _shared_error(f"{mod_name}.{attr}", owner)
    params = [p for p, _ in found.values()]
    return params, [locs for _, locs in found.values()]


def _shared_error(name: str, owner: Unit) -> ValueError:
    return ValueError(
        f"parameter '{name}' is shared with the unit {type(owner.module).__name__}, which "
        "does not contain this use of it. A shared (tied) parameter must live in one unit: "
        "do not shard a module holding only some of its users; shard a common parent instead")


def _names(module: nn.Module, params):
    ids = {id(p) for p in params}
    return [(n, p) for n, p in module.named_parameters() if id(p) in ids]


def _check_same_on_all_ranks(unit: Unit, module: nn.Module, params) -> None:
    """One small all-gather: every rank must be sharding the same structure, or none trains."""
    if comm.simulated(unit.group):  # no other ranks to disagree with
        return
    desc = [type(module).__name__, unit.stage.number, str(unit.param_dtype)]
    desc += [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in _names(module, params)]
    digest = int.from_bytes(hashlib.blake2b(repr(desc).encode(), digest_size=7).digest(), "big")
    mine = torch.tensor([digest], dtype=torch.int64, device=unit.unsharded.device)
    every = torch.empty(unit.world_size, dtype=torch.int64, device=mine.device)
    comm.all_gather(every, mine, group=unit.group, unit=unit.name, phase="init")
    if (every != mine).any():
        descs = comm.all_gather_object(desc, group=unit.group)
        differ = [r for r, d in enumerate(descs) if d != descs[0]]
        raise ValueError(
            f"ranks shard different modules: rank 0 has {descs[0]}, but ranks {differ} have "
            f"{[descs[r] for r in differ]}. Build the same model (same structure, shapes, "
            "dtypes, requires_grad) and call zero.shard in the same order on every rank")


# ---- the optimizer: one global pair of hooks for all optimizers ------------------------------

_hooks_installed = False


def _install_optimizer_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


def _our_units(optimizer):
    units = {}  # ordered, deduplicated: the same order on every rank
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_zero_replaced", False):
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter that zero.shard replaced by "
                    "its shard: the optimizer was built before sharding. Build it after "
                    "zero.shard, from model.parameters()")
            unit = getattr(p, "_zero_unit", None)
            if unit is not None:
                units[unit] = None
    return list(units)


def _before_step(optimizer, args, kwargs) -> None:
    for unit in _our_units(optimizer):
        unit.wait_unshard()  # an in-place gather may still read the shard the step writes


def _after_step(optimizer, args, kwargs) -> None:
    for unit in _our_units(optimizer):
        unit.shard_changed()


# ---- model-level helpers -----------------------------------------------------------------------


def units_of(model: nn.Module) -> list[Unit]:
    """The units in ``model``, in module order (the same order on every rank)."""
    units = [m._zero_unit for m in model.modules() if getattr(m, "_zero_unit", None)]
    if not units:
        raise ValueError(f"{type(model).__name__} has no unit: call zero.shard on it first")
    return units


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients over micro-batches without communication (like DDP's ``no_sync``).

    Inside, backward leaves each unit's full flat gradient in place (full-size, as in DDP);
    the first backward outside reduces everything accumulated.
    """
    units = units_of(model)
    before = [u.requires_grad_sync for u in units]
    for u in units:
        u.requires_grad_sync = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u.requires_grad_sync = b
