"""A backend that writes every collective to a file before launching it: the seam, used.

``zero.shard(..., backend=LoggingBackend("rank0.log"))`` (each rank its own file) logs every
collective of those units, and of ``zero.save`` / ``zero.load``, one line each, in order::

    all_gather float32 (16896,) <- (8448,) ranks=2

and answers every other question as the backend it wraps: ``zero/api.py``'s ``Backend`` seam.
"""

from __future__ import annotations

import os

import torch

from zero.comm.backend import TorchBackend


class LoggingBackend:
    """Args:
    path: the file to append to (made if missing).
    inner: the backend that really moves the data (default ``TorchBackend()``).
    """

    def __init__(self, path: str | os.PathLike, inner=None):
        self.path, self.inner = os.fspath(path), inner if inner is not None else TorchBackend()

    def __repr__(self) -> str:  # (the ranks agree on it: each may log to its own file)
        return f"LoggingBackend(inner={self.inner!r})"

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # rank, world_size, bounded_wait...: as the inner

    def _log(self, op: str, output: torch.Tensor, input: torch.Tensor, group) -> None:
        with open(self.path, "a") as f:
            f.write(f"{op} {str(output.dtype).removeprefix('torch.')} {tuple(output.shape)} <- "
                    f"{tuple(input.shape)} ranks={self.inner.world_size(group)}\n")

    def all_gather(self, output, input, group, async_op: bool):
        self._log("all_gather", output, input, group)
        return self.inner.all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, op: str, group, async_op: bool):
        self._log(f"reduce_scatter({op})", output, input, group)
        return self.inner.reduce_scatter(output, input, op, group, async_op)

    def all_to_all(self, output, input, group, async_op: bool):
        self._log("all_to_all", output, input, group)
        return self.inner.all_to_all(output, input, group, async_op)

    def all_reduce(self, tensor, op: str, group, async_op: bool):
        self._log(f"all_reduce({op})", tensor, tensor, group)
        return self.inner.all_reduce(tensor, op, group, async_op)

    def broadcast(self, tensor, src: int, group, async_op: bool):
        self._log(f"broadcast(from {src})", tensor, tensor, group)
        return self.inner.broadcast(tensor, src, group, async_op)
