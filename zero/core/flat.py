"""The flat parameter: one unit's parameters laid end to end in a padded 1-D buffer.

ZeRO's partitioning (Rajbhandari et al. 2020, section 5), FSDP1's ``FlatParameter``: padded
so its length divides N, rank r owns ``[r * S, (r + 1) * S)``, ``S = padded_numel / N``::

    flat:   | p0 ........ | p1 .... | p2 ...... |pad|
    shards: | rank 0        | rank 1        | rank 2        |

What rank r holds of parameter i is a *piece*, a contiguous run (notes/01-flat-parameter.md).

[Note: the layout interface] Who holds which element is a policy: flat pieces (here), FSDP2's rows
(``zero/core/rows.py``) or whole parameters (``zero/core/whole.py``), each with ``padded_numel``,
``shard_numel``, ``pieces``, ``local``, ``views``, and ``copies``, ``from_wire`` / ``to_wire`` and
``exposed`` for a layout whose gathered buffer is not the compute buffer (notes/16-layouts.md).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from zero.api import Layout, Piece, ShardInfo  # (the values every layout returns)


class FlatLayout:
    """Where each of ``shapes`` (0-d and empty allowed) lives in the flat buffer and each shard."""

    name = "flat"
    copies = False  # the all-gather's buffer is the one the parameters view
    empty_pieces_get_grads = True  # a rank that holds none of a parameter gets an empty .grad
    exposes_dtensors = False  # parameters shown as DTensors of their full shape (FSDP2's)
    whole_parameters = False  # each parameter whole on one rank, in its own shape

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.world_size = world_size
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world_size)  # ceil: every shard the same size
        self.padded_numel = self.shard_numel * world_size

    def shard(self, rank: int) -> ShardInfo:
        return ShardInfo(offset=rank * self.shard_numel, size=self.shard_numel)

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty pieces of parameters in rank ``rank``'s shard, in flat order."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for i, (start, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append(Piece(i, param_offset=a - start, shard_offset=a - lo, length=b - a))
        return out

    def local(self, rank: int) -> "LocalShard":
        """What rank ``rank`` holds of this layout: its slot and its pieces."""
        return LocalShard(self, rank)

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate ``tensors`` (in layout order) into a new zero-padded 1-D buffer."""
        if [t.shape for t in tensors] != self.shapes:
            raise ValueError("tensors do not match the layout's shapes")
        like = tensors[0] if tensors else torch.empty(0)
        flat = like.new_zeros(self.padded_numel)
        for t, start, n in zip(tensors, self.offsets, self.numels):
            flat[start : start + n].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the original shapes into an unsharded flat buffer, by one ``split``."""
        if flat.shape != (self.padded_numel,):
            raise ValueError(f"expected a ({self.padded_numel},) buffer, got {tuple(flat.shape)}")
        pad = self.padded_numel - self.numel
        chunks = flat.split(self.numels + [pad])
        return [c.view(shape) for c, shape in zip(chunks, self.shapes)]

    def from_wire(self, wire: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The compute buffer of a gathered (N*S,) buffer: here the same tensor."""
        return wire

    def to_wire(self, compute: torch.Tensor) -> torch.Tensor:
        """The (N*S,) buffer to reduce-scatter from a compute buffer: here the same tensor."""
        return compute

    def exposed(self, piece: torch.Tensor, i: int, rank: int, group) -> torch.Tensor:
        """How this rank's piece of parameter i is shown to the optimizer: as it is, 1-D."""
        return piece


class LocalShard:
    """One rank's share of a layout: its slot of the flat buffer and its piece of each parameter."""


    def __init__(self, layout: Layout, rank: int):
        self.layout, self.rank = layout, rank
        info = layout.shard(rank)
        self.slot = slice(info.offset, info.offset + info.size)  # in the (N*S,) flat buffer
        self.pieces = {p.param_index: p for p in layout.pieces(rank)}

    def piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's piece of a shard-sized buffer (empty if this rank holds none of it)."""
        piece = self.pieces.get(i)
        return shard[piece.shard_offset :][: piece.length] if piece else shard[:0]
