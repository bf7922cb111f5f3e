"""zero: ZeRO stages 1, 2 and 3, written from scratch on torch.distributed collectives.

Read in this order: ``flat`` (the flat parameter), ``comm`` (collectives and the ledger),
``unit`` (one mechanism, the stage as a policy), ``shard`` (the public entry point), then
``mixed_precision``, ``clip``, ``state_dict``, ``checkpoint`` and ``memory``.
"""

from zero.clip import clip_grad_norm_
from zero.comm import Ledger
from zero.mixed_precision import MixedPrecision
from zero.shard import no_sync, shard, units_of
from zero.state_dict import full_state_dict


def __getattr__(name: str):
    # zero.save and zero.load come from zero/checkpoint.py on first use, not at import: that
    # module also runs as `python -m zero.checkpoint`, which must find it not yet imported.
    if name in ("save", "load"):
        from zero import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'zero' has no attribute {name!r}")


__all__ = [
    "Ledger",
    "MixedPrecision",
    "clip_grad_norm_",
    "full_state_dict",
    "load",
    "no_sync",
    "save",
    "shard",
    "units_of",
]
