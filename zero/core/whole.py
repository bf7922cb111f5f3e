"""Whole parameters: each parameter entirely on one rank, as ``ZeroRedundancyOptimizer`` does.

For optimizers that read a parameter whole (Adafactor, Muon, Shampoo); the largest first, to
the rank holding the fewest elements::

    flat buffer:  | r0: p1 .......... p3 ... |pad|| r1: p0 ....... p2 ..... |
    rank 0 holds p1 and p3, whole, in their shapes; rank 1 holds p0 and p2

notes/16-layouts.md, "whole". The interface is ``zero/core/flat.py``'s (its note).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from zero.api import Piece, ShardInfo
from zero.core.flat import LocalShard


class WholeLayout:
    """Each of ``shapes`` whole on one of ``world_size`` ranks (see the module docstring)."""


    name = "whole"
    copies = False  # each parameter is contiguous in the gathered buffer
    empty_pieces_get_grads = False  # only the owner's optimizer steps a parameter
    exposes_dtensors = False  # parameters shown as DTensors of their full shape (FSDP2's)
    whole_parameters = True  # each parameter whole on one rank, in its own shape

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.numels)
        self.world_size = world_size
        held = [0] * world_size
        self.owner = [0] * len(self.shapes)
        for i in sorted(range(len(self.shapes)), key=lambda i: -self.numels[i]):  # stable
            rank = min(range(world_size), key=lambda r: held[r])  # ties: the lowest rank
            self.owner[i] = rank
            held[rank] += self.numels[i]
        self.shard_numel = max(held, default=0)
        self.padded_numel = world_size * self.shard_numel
        self.where = [0] * len(self.shapes)  # each parameter's offset in its owner's shard
        filled = [0] * world_size
        for i, rank in enumerate(self.owner):  # in the unit's order within each rank
            self.where[i] = filled[rank]
            filled[rank] += self.numels[i]
        # the flat buffer as one run of segments, in buffer order: parameters and paddings
        self._segments: list[tuple[int, int | None]] = []  # (numel, parameter index or None)
        for rank in range(world_size):
            mine = sorted((i for i in range(len(self.shapes)) if self.owner[i] == rank),
                          key=lambda i: self.where[i])
            self._segments += [(self.numels[i], i) for i in mine]
            self._segments.append((self.shard_numel - filled[rank], None))

    @property
    def padding(self) -> int:
        """Elements of padding in the whole flat buffer (what ``flat`` would not need)."""
        return self.padded_numel - self.numel

    def shard(self, rank: int) -> ShardInfo:
        return ShardInfo(offset=rank * self.shard_numel, size=self.shard_numel)

    def pieces(self, rank: int) -> list[Piece]:
        return [Piece(i, param_offset=0, shard_offset=self.where[i], length=self.numels[i])
                for i in range(len(self.shapes)) if self.owner[i] == rank and self.numels[i]]

    def local(self, rank: int) -> LocalShard:
        return LocalShard(self, rank)

    def views(self, compute: torch.Tensor) -> list[torch.Tensor]:
        """The parameters in the flat buffer, all made by one ``split`` (as with ``flat``)."""
        parts = compute.split([n for n, _ in self._segments])
        views: list = [None] * len(self.shapes)
        for part, (_, i) in zip(parts, self._segments):
            if i is not None:
                views[i] = part.view(self.shapes[i])
        return views

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        compute = tensors[0].new_zeros(self.padded_numel)
        for v, t in zip(self.views(compute), tensors):
            v.copy_(t)
        return compute

    def from_wire(self, wire: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        return wire

    def to_wire(self, compute: torch.Tensor) -> torch.Tensor:
        return compute

    def exposed(self, piece: torch.Tensor, i: int, rank: int, group) -> torch.Tensor:
        """The whole parameter on its owner; elsewhere an empty tensor of as many dims."""
        shape = self.shapes[i]
        if self.owner[i] == rank:
            return piece.view(shape)
        return piece.view(0, *shape[1:]) if len(shape) else piece.view(0)
