"""``zero.init_parameters``: fill a model that was sharded straight from the meta device.

The random draws are replayed in their order, each module's parameters at full size in turn, so
the values are the full model's; a rank holds the root and one other unit whole at most
(notes/09-scale.md, "Why it replays ``model.modules()``"). FSDP2's way is ``to_empty``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from zero.core import placement, registry
from zero.core.registry import units_of


def reset_parameters(module: nn.Module) -> None:
    """The default ``init_fn``: the module's own ``reset_parameters`` (nn.Linear, ...)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


@torch.no_grad()
def init_parameters(model: nn.Module, init_fn: Callable[[nn.Module], None] = reset_parameters,
                    ) -> None:
    """Initialise a model sharded from the meta device, one unit at a time.

    The result equals building ``model`` on a real device, calling ``init_fn(m)`` for every
    ``m`` in ``model.modules()`` (in that order, from the same random state), and then
    sharding it: ``zero.full_state_dict`` is bitwise the same.

    Args:
        model: a model whose units were all sharded from the meta device.
        init_fn: called once per module, with the module's own parameters (and buffers)
            materialised at full size; it must initialise them in place.
    """
    units = units_of(model)
    placement.refuse(units, "zero.init_parameters", "give the model memory with "
                     "model.to_empty(device=...) and run its own init on the DTensors, as on FSDP2")
    if any(u.materialized and u.params for u in units):
        raise RuntimeError("init_parameters is for models sharded from the meta device; "
                           "this one already has values")
    modules = list(model.modules())
    def unit_of(m: nn.Module) -> set:  # the units of m's own parameters (not yet swapped out)
        return {registry.unit_of(p) for p in m._parameters.values()} - {None}

    last = {u: i for i, m in enumerate(modules) for u in unit_of(m)}  # each unit's last module
    full: dict = {}  # unit -> its temporary full flat buffer, while it is being initialised
    for i, mod in enumerate(modules):
        for u in unit_of(mod):
            if u not in full:
                full[u] = _full_size(u)
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros_like(buf, device=units[0].sharded.device)
        init_fn(mod)
        for u in [u for u in full if last[u] == i]:
            u.sharded.copy_(u.layout.to_wire(full.pop(u))[u.local.slot])
            u.params_on_shard()  # (fully_shard showed them on meta until now)
            u.use_sharded_params()
            u.shard_changed(phase="init")  # stages 1/2: gather the full parameters
    for u in units:  # units with no parameters of their own
        if not u.materialized:
            u.shard_changed(phase="init")


def _full_size(unit) -> torch.Tensor:
    """A zeroed full flat buffer for ``unit``, its views put in the modules for init_fn."""
    full = torch.zeros(unit.layout.padded_numel, dtype=unit.sharded.dtype,
                       device=unit.sharded.device)
    unit.use(unit.layout.views(full))  # plain tensors, for init_fn to fill in place
    return full


def to_empty(model: nn.Module, device) -> None:
    """``model.to_empty(device=...)`` after ``fully_shard`` on meta: the rest, uninitialised."""
    device = torch.device(device)
    units = registry.units_of(model)
    where = units[0].sharded.device
    if device.type != where.type or (device.type != "cpu" and device.index is not None
                                     and device.index != where.index):
        raise ValueError(
            f"to_empty(device={device}) but the shards of this model live on {where}: "
            "shard it for that device (zero.fully_shard(..., device=...)), or initialise "
            "from the meta device with zero.init_parameters(model, init_fn)")
    pieces = [u for u in units if not u.materialized and not u.layout.exposes_dtensors]
    if pieces:
        raise ValueError(
            f"to_empty() after zero.fully_shard(layout={pieces[0].layout.name!r}) on the "
            "meta device: the parameters it shows are this rank's pieces, which a module's "
            "own initialisation (reset_parameters, as Lightning's empty_init calls it) "
            "cannot fill: its fan-in needs the full shape. Use layout='rows' (FSDP2's, "
            "fully_shard's default: DTensors of the full shape), or fill the shards with "
            "zero.init_parameters(model, init_fn) instead of to_empty()")
    for m in model.modules():
        for name, t in list(m._buffers.items()):
            if t is not None and t.is_meta:
                m._buffers[name] = torch.empty_like(t, device=device)
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta and not registry.is_piece(p):
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device=device),
                                                   requires_grad=p.requires_grad)
    for unit in units:
        unit.params_on_shard()  # each parameter, the same object, now shows its pieces
        unit.materialized = True  # the model's init writes the shards (through DTensors)
