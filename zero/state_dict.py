"""``zero.full_state_dict``: the model's state, whole and in the original shapes.

Each unit's shard is all-gathered into a temporary flat buffer, whose views are put where
the module uses its parameters; then torch's own ``nn.Module.state_dict`` runs, so the keys
are exactly the unsharded model's: tied parameters under every name that uses them,
persistent buffers, extra state, and whatever the model's state-dict hooks add (as FSDP2's
``get_model_state_dict(..., full_state_dict=True)``). Collective: call on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero import comm
from zero.shard import units_of


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the unsharded model's ``state_dict()`` on every rank (fp32 master values, not
    the compute copy)."""
    units = units_of(model)  # the same order on every rank
    try:
        for unit in units:
            flat = unit.sharded.new_empty(unit.layout.padded_numel)
            # (S,) per rank -> (N*S,): the master weights, whole
            comm.all_gather(flat, unit.sharded, group=unit.group, unit=unit.name, phase="other")
            unit.use(unit.layout.views(flat))
        return nn.Module.state_dict(model)
    finally:
        for unit in units:
            unit.use_sharded_params()
