"""What a unit refuses: each check was a silent wrong result once, and raises naming the fix."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from zero.core.param import AS_IS
from zero.core.same_model import values

# zero's own state-dict helpers running in this thread: ``zero/surface/attach.py`` lets them by
_STATE_DICT_ACCESS: ContextVar[int] = ContextVar("zero_state_dicts", default=0)


@contextlib.contextmanager
def state_dict_access():
    """For zero's own helpers, which put full tensors in place before calling state_dict."""
    token = _STATE_DICT_ACCESS.set(_STATE_DICT_ACCESS.get() + 1)
    try:
        yield
    finally:
        _STATE_DICT_ACCESS.reset(token)


def state_dict_access_granted() -> bool:
    return _STATE_DICT_ACCESS.get() > 0


def _key(t) -> int:
    return t.untyped_storage()._cdata


def converted_after_sharding(unit) -> None:
    """Raise if ``model.half()`` / ``.to(device)`` after sharding swapped a piece's data."""
    key = _key(unit.sharded)
    for p, locs in zip(unit.params, unit.locations):
        if not locs:
            continue  # a piece no module uses (a tie made after sharding: zero/core/adoption.py)
        mod, attr = locs[0]
        if p.is_meta and not unit.sharded.is_meta:  # (a shard on meta is an offload policy's)
            on_meta(unit, moved=False)  # shown on meta, never given values
        if (mod._parameters.get(attr) is not p or p.dtype != unit.sharded.dtype
                or p.device != unit.sharded.device or _key(values(p)) != key):
            converted(unit, p)


def converted(unit, p) -> None:
    raise RuntimeError(
        f"the parameters of unit {unit.name} were converted after zero.shard (now {p.dtype} on "
        f"{p.device}, sharded as {unit.sharded.dtype} on {unit.sharded.device}): model.to(), "
        ".half(), .double() or .cuda() after sharding detach them from their shard. Convert the "
        "model before zero.shard, or compute in another dtype with zero.shard(..., "
        "mp_policy=zero.MixedPrecision(param_dtype=...))")


def on_meta(unit, moved: bool) -> None:
    """The parameters are on meta: never given values, or ``moved`` there after sharding."""
    if not moved:
        raise RuntimeError(
            f"the parameters of unit {unit.name} are still on the meta device: the model was "
            "sharded there and never given values. Before the first forward, call "
            "model.to_empty(device=...) and initialise it (each module's reset_parameters(), "
            "or zero.init_parameters), or load full weights with load_state_dict(sd, "
            "assign=True); a load_state_dict without assign=True copies into tensors on meta, "
            "which keeps nothing (torch warns so)")
    raise RuntimeError(
        f"the parameters of unit {unit.name} were moved to the meta device after zero.shard "
        "(model.to('meta')): the module no longer computes with its shards, which keep their "
        "values where they are. Leave a sharded model where it is; to start from no values, "
        "build the model on the meta device and shard it there, then zero.init_parameters "
        "(or model.to_empty and reset_parameters) or a load")


def replaced_in_forward(unit) -> None:
    """Raise if a module replaced or cast its own weights in forward (its gradient is lost)."""
    key = unit.storage_key()
    for sp, v, locs in zip(unit.sharded_params, unit.iteration.views or [], unit.locations):
        for mod, attr in locs:
            t = mod._parameters.get(attr)
            # (a parameter computing in a form of its own, a DTensor say, holds the view inside)
            if t is not v or (t.numel() and sp.form is AS_IS and _key(t) != key):
                path = next(n for top in unit.modules for n, m in top.named_modules() if m is mod)
                name = ".".join(s for s in (unit.name, path, attr) if s and s != "root")
                raise RuntimeError(
                    f"'{name}' was replaced during forward (e.g. module.to(dtype) inside forward): "
                    f"it no longer computes with unit {unit.name}'s {unit.config.param_dtype} "
                    "parameters, and its gradient would be lost. If it must compute in another "
                    "dtype (a router in fp32), shard the module that owns it as its own unit "
                    "first, with zero.shard(module, mp_policy=None)")


def freed_in_backward(unit) -> None:
    """Backward reads a tensor saved from the unit's storage (``zero/core/saved_tensors.py``)."""
    if not unit.is_unsharded:
        raise RuntimeError(
            f"backward needs the parameters of unit {unit.name}, but its flat parameter was "
            "freed after forward and never gathered again: zero found no tensor requiring "
            "grad in the unit's output (it looks inside tensors, tuples, lists, dicts, "
            "namedtuples and dataclasses), so its pre-backward hook never ran. Return the "
            "output in one of those, or shard this unit with reshard_after_forward=False")
    unit.wait_unshard()


def deepcopy(unit) -> None:
    raise TypeError(
        f"copy.deepcopy of a model sharded by zero (unit {unit.name}) is not supported: "
        "its parameters are views into shards that a copy would not share. Copy the model "
        "before sharding it and shard the copy the same way (an EMA model, for example), "
        "or copy zero.full_state_dict(model)")
