"""The one place that calls ``torch.distributed``: the seam for another backend.

``TorchBackend`` is ``zero/api.py``'s ``Backend``: each method is the ``torch.distributed``
call of the same name, the group explicit; the root's ``CommContext`` holds one, which another
(``zero/features/logging_backend.py``) may wrap or replace. What moves no data (making groups and
meshes) is not here: notes/15, "What does not go through the backend".
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from zero.comm import waits


def _all_gather_flat(*args, **kwargs):
    # torch 2.13 renamed the flat collectives; older releases only have the old names. Looked
    # up at each call, so that whatever wraps torch.distributed meanwhile (an emulation) sees it.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(*args, **kwargs)


def _reduce_scatter_flat(*args, **kwargs):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(*args, **kwargs)


OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


# [Note: bounded waits] gloo honours ``Work.wait(timeout)`` but for its reduce-scatter (torch
# 2.13), waited for on a helper thread. NCCL's ``wait(timeout)`` blocks the CPU until the
# collective completes: there only the waits whose result the CPU reads anyway are bounded.
_BOUNDED = ("gloo", "fake")  # backends whose wait(timeout) does not block on the device
_IGNORED = {("gloo", "reduce_scatter")}  # ... but whose wait ignores the timeout for this op


def _moves_host_memory(pg) -> bool:
    """Whether ``pg`` has a backend for CPU tensors (gloo's, or a multi-backend group's)."""
    try:
        pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


class TorchBackend:
    """The module docstring's; it holds no state: one is as good as another."""

    def __repr__(self) -> str:
        return "TorchBackend()"

    def rank(self, group=None) -> int:
        return dist.get_rank(group)

    def world_size(self, group=None) -> int:
        return dist.get_world_size(group)

    def name(self, group=None) -> str:
        """The backend's name: "gloo", "nccl", "fake" (a simulation)..."""
        return dist.get_backend(group)

    def world(self):
        """The default group (every rank)."""
        return dist.group.WORLD

    def global_rank(self, group, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    def default_device(self, group=None) -> torch.device:
        """Where a small tensor for ``group``'s collectives lives: the CPU for gloo, else the
        current accelerator (NCCL moves only device memory)."""
        accelerator = torch.accelerator.current_accelerator()
        if self.name(group) in ("gloo", "fake") or accelerator is None:
            return torch.device("cpu")
        return torch.device(accelerator.type, torch.accelerator.current_device_index())

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
        """(S,) per rank -> (N*S,), rank r's input at [r*S, (r+1)*S)."""
        return _all_gather_flat(output, input, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, group,
                       async_op: bool):
        """(N*S,) per rank -> (S,): slice r of the reduction over ranks, on rank r."""
        return _reduce_scatter_flat(output, input, op=OPS[op], group=group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
        """(N*C,) per rank -> (N*C,): chunk s of rank r's input is chunk r of rank s's output."""
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str, group, async_op: bool):
        return dist.all_reduce(tensor, op=OPS[op], group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group, async_op: bool):
        """``src`` is a rank of ``group``."""
        return dist.broadcast(tensor, src=self.global_rank(group, src), group=group,
                              async_op=async_op)

    def host_group(self, group):
        """A group of ``group``'s ranks that moves host memory (``CommContext.host``): ``group``
        itself where it has a CPU backend too, else a new gloo group bounded by ``ZERO_TIMEOUT``."""
        pg = group if group is not None else dist.group.WORLD
        if _moves_host_memory(pg):
            return group
        seconds = waits.timeout_seconds() or 1800.0  # (0: torch's default, 30 minutes)
        return dist.new_group(dist.get_process_group_ranks(pg), backend="gloo",
                              timeout=datetime.timedelta(seconds=seconds),
                              use_local_synchronization=True)

    def bounded_wait(self, group, op: str) -> str:
        """How a wait on it can be bounded (the note above): "timeout" (the handle's own),
        "thread" (on a helper thread) or "none" (only a wait the CPU reads at once)."""
        kind = self.name(group)
        if kind not in _BOUNDED:
            return "none"
        return "thread" if (kind, op) in _IGNORED else "timeout"
