"""Checkpoints: sharded, atomic, in FSDP2's layout, and read as data only: ``dcp`` (save,
export), ``loading``, ``directory`` (versions), ``validate``, ``reader`` and ``safe_pickle``
(reading as data), ``fsdp2_layout`` (FSDP2's chunks to and from our shards)."""

from zero.checkpoint.dcp import export, save, state_dict
from zero.checkpoint.loading import load

__all__ = ["export", "load", "save", "state_dict"]
