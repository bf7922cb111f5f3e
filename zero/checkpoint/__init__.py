"""Checkpoints: sharded, atomic, in FSDP2's layout, and read as data only.

- ``dcp``: ``zero.save`` / ``zero.load`` / ``export`` on torch's DCP;
- ``directory``: the version directories, the atomic flip of ``latest``, the checks on disk;
- ``reader``: how DCP reads a checkpoint here (checked records, values loaded as data);
- ``safe_pickle``: ``.metadata`` unpickled against an allow-list;
- ``fsdp2_layout``: FSDP2's per-parameter chunks, to and from our flat shards.
"""

from zero.checkpoint.dcp import export, load, save, state_dict

__all__ = ["export", "load", "save", "state_dict"]
