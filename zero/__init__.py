"""zero: ZeRO stages 1, 2 and 3, written from scratch on torch.distributed collectives.

Read in this order: ``flat`` (the flat parameter), ``comm`` (collectives and the ledger),
``stage`` (the policy table), ``unit`` and ``root`` (one mechanism), ``shard`` (the public
entry point), then ``mixed_precision``, ``clip``, ``state_dict``, ``init`` (meta-device
initialisation), ``checkpoint`` and ``memory``.
"""

from zero.checkpoint import load, save
from zero.clip import clip_grad_norm_
from zero.comm import Ledger
from zero.init import init_parameters
from zero.mixed_precision import MixedPrecision, ShardedGradScaler
from zero.shard import no_sync, shard, units_of
from zero.state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "Ledger",
    "MixedPrecision",
    "clip_grad_norm_",
    "full_state_dict",
    "init_parameters",
    "load",
    "load_full_state_dict",
    "no_sync",
    "save",
    "ShardedGradScaler",
    "shard",
    "units_of",
]
