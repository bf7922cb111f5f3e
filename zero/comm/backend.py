"""The one place that calls ``torch.distributed``: the seam for another backend.

Everything above this file moves data through these few functions, so another transport (a
simulator, a different library, a quantizing wrapper) replaces this file and nothing else.
Each function is the ``torch.distributed`` call of the same name, with the group made
explicit; the ledger, the agreement and the local shortcuts for a group of one rank live
above it (``zero/comm/collectives.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


def world():
    """The default group (every rank)."""
    return dist.group.WORLD


def rank(group=None) -> int:
    return dist.get_rank(group)


def world_size(group=None) -> int:
    return dist.get_world_size(group)


def name(group=None) -> str:
    """The backend's name: "gloo", "nccl", "fake"..."""
    return dist.get_backend(group)


def global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def new_group(ranks: list[int]):
    return dist.new_group(ranks)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """(S,) per rank -> (N*S,), rank r's input at [r*S, (r+1)*S)."""
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group, async_op: bool):
    """(N*S,) per rank -> (S,): slice r of the reduction over ranks, on rank r."""
    return _reduce_scatter_flat(output, input, op=OPS[op], group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """(N*C,) per rank -> (N*C,): chunk s of rank r's input lands as chunk r of rank s's output."""
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: str, group, async_op: bool):
    return dist.all_reduce(tensor, op=OPS[op], group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool):
    """``src`` is a rank of ``group``."""
    return dist.broadcast(tensor, src=global_rank(group, src), group=group, async_op=async_op)


def all_gather_object(obj: Any, group) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def alone(group=None) -> bool:
    """A group of one rank has nobody to talk to."""
    return dist.get_world_size(group) == 1


def simulated(group=None) -> bool:
    """True for the fake process group (benchmarks/simulate.py): it moves no data and has no
    other ranks, so checks that compare ranks have nothing to compare."""
    return dist.get_backend(group) == "fake"


def default_device(group=None) -> torch.device:
    """Where a small tensor for ``group``'s collectives lives: the CPU for gloo, else the
    current accelerator (NCCL moves only device memory)."""
    accelerator = torch.accelerator.current_accelerator()
    if dist.get_backend(group) in ("gloo", "fake") or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
