"""Checkpoints: sharded, atomic, in FSDP2's layout, and read as data only.

- ``dcp``: ``zero.save`` / ``state_dict`` / ``export`` on torch's DCP;
- ``loading``: ``zero.load``, one unit at a time;
- ``directory``: the version directories, the atomic flip of ``latest``, keep-last-K, the lock;
- ``validate``: what is checked on disk before a byte is read;
- ``reader``: how DCP reads a checkpoint here (checked records, values loaded as data);
- ``safe_pickle``: ``.metadata`` unpickled against an allow-list, in memory proportional to it;
- ``fsdp2_layout``: FSDP2's per-parameter chunks, to and from our flat shards.
"""

from zero.checkpoint.dcp import export, save, state_dict
from zero.checkpoint.loading import load

__all__ = ["export", "load", "save", "state_dict"]
