"""What the collectives layer keeps between calls, in one object per model: a ``CommContext``.

A collective needs more than its buffers: the backend that moves them (``zero/comm/backend.py``
or one that wraps it), a name for its group in the ledger ("intra-node"...), its number among
the collectives this rank issued on that group (for the message of a wait that expires), the
last few issued (for the same message), and how many agreements the ranks made so far (they
must count alike). FSDP2 keeps the like in its ``FSDPCommContext``; here each ``zero.shard``
call makes one for its units (``MeshInfo.context``), and every collective of theirs (and of
``zero.save``/``zero.load`` on them) is issued through it. A call with no context (a test of
the collectives alone) gets a fresh one with the default backend.
"""

from __future__ import annotations

import collections

from zero.comm.backend import TorchBackend


class CommContext:
    """Args:
    backend: the ``Backend`` every collective goes through (default: ``TorchBackend()``,
        ``torch.distributed`` itself).
    """

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else TorchBackend()
        self._names: dict = {}  # group -> its name in the ledger
        self._counts: dict = {}  # group -> collectives this rank issued on it
        self._sequences: dict = {}  # group -> agreements so far: the ranks must count alike
        self.last: collections.deque = collections.deque(maxlen=3)  # the last few issued

    def _key(self, group):
        return self.backend.world() if group is None else group

    def name_group(self, group, name: str) -> None:
        """Give ``group`` a name for the ledger (HSDP's "intra-node" and "inter-node")."""
        self._names[self._key(group)] = name

    def group_name(self, group) -> str:
        key = self._key(group)
        default = "world" if key is self.backend.world() else \
            f"{self.backend.world_size(group)} ranks"
        return self._names.get(key, default)

    def issued(self, what: str, group) -> str:
        """Number a collective this rank issues on ``group``; returns how messages name it."""
        key = self._key(group)
        n = self._counts[key] = self._counts.get(key, 0) + 1
        name = f"#{n} {what}"
        self.last.append(name)
        return name

    def next_agreement(self, group) -> int:
        key = self._key(group)
        seq = self._sequences[key] = self._sequences.get(key, 0) + 1
        return seq


def context_of(ctx: CommContext | None) -> CommContext:
    """``ctx``, or a fresh default context for a call that gave none."""
    return ctx if ctx is not None else CommContext()
