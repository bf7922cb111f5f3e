"""Counting the bytes any system sends, from the outside (for DDP and FSDP2 too).

``CommBytes`` watches the dispatcher, as torch's ``CommDebugMode`` does, and adds up the bytes
each rank sends with the same ring accounting as our ledger (zero/comm/ledger.py), N the size
of the collective's group: (N-1)/N of the full buffer for an all-gather, a reduce-scatter, an
all-to-all or a broadcast (the average over ranks of a pipelined ring broadcast), 2(N-1)/N for
an all-reduce. Our own collectives pass the same dispatcher, so for our stages ``CommBytes``
and the ledger must agree: the benchmark checks that they do.

It is a dispatch mode of its own, not ``CommDebugMode``: that one also tracks modules, by
hooking each module again every time it is called, which breaks on a module object called more
than once in a forward (transformers 5.25's ``apply_rotary_pos_emb``, one module shared by every
Llama layer: an ``IndexError`` in ``_comm_mode.py``, and hooks left on the module). Counting
bytes needs no module at all.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops as _COLLECTIVES
from torch.utils._python_dispatch import TorchDispatchMode

c10d = torch.ops.c10d

def _size(tensors, bytes_: bool) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * (tensors.element_size() if bytes_ else 1)
    return sum(_size(t, bytes_) for t in tensors)


# op -> (name, which argument is the full buffer, ring factor)
_OPS = {
    c10d._allgather_base_.default: ("all_gather", 0, 1),
    c10d.allgather_.default: ("all_gather", 0, 1),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0, 1),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1, 1),
    c10d.reduce_scatter_.default: ("reduce_scatter", 1, 1),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1, 1),
    c10d.allreduce_.default: ("all_reduce", 0, 2),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0, 2),
    c10d.broadcast_.default: ("broadcast", 0, 1),
    c10d.alltoall_base_.default: ("all_to_all", 1, 1),  # (each rank keeps its own chunk)
}


def _group_size(func, args, default: int) -> int:
    """The size of the process group a c10d op runs on (its ``process_group`` argument)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "process_group" and i < len(args):
            return dist.ProcessGroup.unbox(args[i]).size()
    return default


def _uncounted(func) -> bool:
    """A collective ``_OPS`` does not account: another c10d op, or a functional one (DTensor's)."""
    space = getattr(func, "namespace", None)
    if space == "c10d":
        return func._overloadpacket in _COLLECTIVES
    return space == "_c10d_functional" and "wait" not in str(func)


class CommBytes(TorchDispatchMode):
    """``with CommBytes() as cb: step()``, then ``cb.sent`` ({op: bytes sent by this rank}),
    ``cb.elements`` (the same in elements: how the ZeRO paper counts Ψ) and ``cb.calls``."""

    def __init__(self, world_size: int | None = None):
        super().__init__()
        self.n = world_size or dist.get_world_size()
        self.sent: Counter = Counter()
        self.elements: Counter = Counter()
        self.calls: Counter = Counter()
        self.unknown: Counter = Counter()  # collectives we do not account (should stay empty)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns its op into plain ops and collectives
        out = func(*args, **(kwargs or {}))
        if func in _OPS:
            name, arg, factor = _OPS[func]
            n = _group_size(func, args, self.n)  # (qgZ's all-to-alls run on a node, or across)
            ring = factor * (n - 1) / n
            self.sent[name] += int(_size(args[arg], True) * ring)
            self.elements[name] += int(_size(args[arg], False) * ring)
            self.calls[name] += 1
        elif _uncounted(func):
            self.unknown[str(func)] += 1
        return out

    def total(self) -> int:
        return sum(self.sent.values())

