"""zero: ZeRO stages 1, 2 and 3, written from scratch on torch.distributed collectives.

New to ZeRO? Read ``minimal`` first: the whole idea in one file. Then, in this order:
``flat`` (the flat parameter), ``comm`` (collectives, the ledger, agreement), ``stage`` (the
policy table), ``unit``, ``hooks``, ``grads`` and ``root`` (one mechanism: a unit's parameters,
its life in one iteration, its gradient, and what the root does for all units), ``shard``
(the public entry point), ``guard``, ``refuse`` and ``outside`` (what stands between a user
and a silent wrong result), then ``mixed_precision``, ``clip``, ``state_dict``,
``controls`` (FSDP2's control surface), ``init`` (meta-device initialisation),
``checkpoint`` and ``memory``.
"""

from zero.checkpoint import load, save
from zero.clip import clip_grad_norm_
from zero.comm import Ledger
from zero.controls import (
    reshard,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from zero.init import init_parameters
from zero.mixed_precision import MixedPrecision, ShardedGradScaler
from zero.shard import no_sync, shard, units_of
from zero.state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "Ledger",
    "MixedPrecision",
    "ShardedGradScaler",
    "clip_grad_norm_",
    "full_state_dict",
    "init_parameters",
    "load",
    "load_full_state_dict",
    "no_sync",
    "reshard",
    "save",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "shard",
    "units_of",
    "unshard",
]
