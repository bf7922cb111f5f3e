"""The model's state whole, in and out: ``zero.full_state_dict`` and ``zero.load_full_state_dict``.

Both put full-size tensors where the modules use their parameters and let torch's own
``nn.Module.state_dict`` / ``load_state_dict`` do the rest, so the keys are exactly the
unsharded model's: tied parameters under every name that uses them, persistent buffers,
extra state, whatever the model's state-dict hooks add (as FSDP2's
``get_model_state_dict(..., full_state_dict=True)``). Out: each unit's shard is all-gathered
(collective: call on every rank). In: each rank copies its own pieces out of the full tensors
(no communication), and the full parameters are refreshed from the new shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero import comm
from zero.core.checks import state_dict_access
from zero.core.registry import units_of


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the unsharded model's ``state_dict()`` on every rank (fp32 master values, not
    the compute copy)."""
    units = units_of(model)  # the same order on every rank
    comm.agree("gather a full state dict", group=units[0].all_group, ctx=units[0].mesh.context,
               fix="Call zero.full_state_dict on every rank (it is collective), then keep what "
                   "you need on rank 0")
    try:
        for unit in units:
            flat = unit.sharded.new_empty(unit.layout.padded_numel)
            # (S,) per rank -> (N*S,): the master weights, whole
            comm.all_gather(flat, unit.sharded, group=unit.group, unit=unit.name, phase="other",
                            ctx=unit.mesh.context)
            unit.use(unit.layout.views(unit.layout.from_wire(flat)))  # (rows: copied out)
        with state_dict_access():
            return model.state_dict()
    finally:
        for unit in units:
            unit.use_sharded_params()


def load_full_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a full (unsharded) state dict, such as ``full_state_dict`` returns, on every rank.

    Returns what ``nn.Module.load_state_dict`` returns (missing and unexpected keys).
    """
    units = units_of(model)
    fulls = {}
    try:
        for unit in units:
            fulls[unit] = unit.sharded.new_zeros(unit.layout.padded_numel)
            unit.use(unit.layout.views(fulls[unit]))  # torch copies each tensor in here
        with state_dict_access():
            result = model.load_state_dict(state_dict, strict=strict)
    finally:
        for unit in units:
            unit.use_sharded_params()
    for unit, flat in fulls.items():
        unit.wait_unshard()  # a stage 1/2 gather may still read the shard
        with torch.no_grad():
            # our slice (rows: of the rank-major buffer); the next forward gathers the rest
            unit.sharded.copy_(unit.layout.to_wire(flat)[unit.local.slot])
    return result
