"""A layout written from zero/api.py alone: the flat layout, its parameters in reverse order.

The unit's parameters laid end to end last-first, padded to N equal slices; each rank holds
one slice, each parameter shown as this rank's 1-D piece (FSDP1's way). At world size 2 it
trains bitwise like DDP, as any layout does there: a sum of two floats has one order.
"""

import math

import torch

from zero.api import Piece, ShardInfo


class ReversedFlat:
    """``zero/api.py``'s ``Layout``."""

    name = "reversed-flat"
    copies = False  # the gathered buffer is the one the parameters view
    empty_pieces_get_grads = True  # (as flat: an empty 1-D .grad)
    exposes_dtensors = False
    whole_parameters = False

    def __init__(self, shapes, world_size):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.order = list(reversed(range(len(shapes))))  # buffer order: the last one first
        self.offsets = [0] * len(shapes)
        at = 0
        for i in self.order:
            self.offsets[i], at = at, at + self.numels[i]
        self.numel = at
        self.shard_numel = -(-at // world_size)
        self.padded_numel = self.shard_numel * world_size

    def shard(self, rank):
        return ShardInfo(rank * self.shard_numel, self.shard_numel)

    def pieces(self, rank):
        lo, hi, out = rank * self.shard_numel, (rank + 1) * self.shard_numel, []
        for i in self.order:
            a, b = max(self.offsets[i], lo), min(self.offsets[i] + self.numels[i], hi)
            if a < b:
                out.append(Piece(i, a - self.offsets[i], a - lo, b - a))
        return out

    def views(self, compute):
        sizes = [self.numels[i] for i in self.order] + [self.padded_numel - self.numel]
        parts = compute.split(sizes)
        views = [None] * len(self.shapes)
        for part, i in zip(parts, self.order):
            views[i] = part.view(self.shapes[i])
        return views

    def from_wire(self, wire, into=None):
        return wire

    def to_wire(self, compute):
        return compute

    def exposed(self, piece, i, rank, placement):
        return piece
