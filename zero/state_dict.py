"""``zero.full_state_dict``: the model's parameters, whole and in their original shapes.

Each unit's shard is all-gathered into a temporary flat buffer and viewed back into the
original shapes. Keys are the unsharded model's ``named_parameters()`` names (a tied
parameter once, under its first name, as in DDP and FSDP2). Collective: call on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero import comm
from zero.shard import units_of


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return ``{name: full parameter}`` on every rank (fp32 master values, not the compute copy)."""
    full = {}
    for unit in units_of(model):  # the same order on every rank
        flat = unit.sharded.new_empty(unit.layout.padded_numel)
        # (S,) per rank -> (N*S,): the master weights, whole
        comm.all_gather(flat, unit.sharded, group=unit.group, unit=unit.name, phase="other")
        full[unit] = unit.layout.views(flat)
    return {
        name: full[p._zero_unit][p._zero_index] if hasattr(p, "_zero_unit") else p.detach()
        for name, p in model.named_parameters()
    }
