"""ZeRO++'s qgZ: the gradient reduce-scatter as two all-to-alls of 4-bit blocks (Wang et al.,
"ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", 2023,
section 3.3).

A ring reduce-scatter in low precision would quantize and dequantize at every one of its
N-1 hops, and its error would grow with N. qgZ sends each value quantized once per hop of
the cluster's two levels, and sums in fp32 between them. With N = n nodes x g ranks a node
(a 2-D mesh, rank i*g + j on node i), shard k of the flat gradient belonging to rank k::

    grad (N*S,)  viewed (n, g, S)          [node i', local j', element]
    reorder      (g, n, S)                 chunk j' = the n shards owned by local rank j'
    hop 1        all-to-all in the node    4-bit blocks + fp32 scales: local rank j gets
                                           every local rank's n shards {i'*g + j}
    sum          (g, n, S) -> (n, S)       dequantized, summed in fp32: the node's part
    hop 2        all-to-all across nodes   4-bit again: node i' gets row i' (shard i'*g + j)
    sum          (n, S) -> (S,)            dequantized, summed: this rank's shard, / N for avg

Bytes each rank sends, with nb = ceil(S/B) blocks a shard (B elements a scale, 1/2 byte an
element): within the node (g-1)/g x N*(nb*B/2 + 4*nb), across nodes (n-1)/n x n*(nb*B/2 +
4*nb), against (N-1)/N x 4*N*S for an fp32 reduce-scatter. Across nodes that is a node's g
ranks sending M/4 in all, M the fp16 gradient's bytes (the paper's 0.25M), less (n-1)/n, plus
the scales. Error: symmetric 4-bit (levels -7..7) is within half a step, a block's largest
magnitude over 14, at each hop; so each element of the sum is within (sum over ranks of the
block's largest magnitude) / 7, plus fp32 rounding (tests/test_quantized_gradients.py).

A communication policy: ``zero.shard(..., comm_policy=QuantizedGradients(mesh))`` with the
unit sharded over all of the mesh's ranks (``group`` the world, or the mesh's ranks). The
all-gathers are ``FlatCollectives``' (or pass ``weights=QuantizedWeights()`` for qwZ too).
"""

from __future__ import annotations

import torch

from zero.comm import backend, collectives, ledger
from zero.comm.flat_collectives import FlatCollectives
from zero.comm.quantized import dequantize_rows, quantize_rows

BLOCK = 128  # elements per scale (ours; 4 bits resolve less than 8, so blocks are smaller)
LEVELS = 7  # symmetric 4-bit: -7..7 (the 16th code is unused)


def pack(q: torch.Tensor) -> torch.Tensor:
    """(R, 2k) int8 in [-7, 7] -> (R, k) uint8, two codes a byte."""
    u = (q + 8).to(torch.uint8).view(q.shape[0], -1, 2)
    return u[:, :, 0] | (u[:, :, 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(R, k) uint8 -> (R, 2k) int8."""
    low, high = packed & 15, packed >> 4
    return (torch.stack([low, high], dim=2).view(packed.shape[0], -1).to(torch.int8) - 8)


class QuantizedGradients(FlatCollectives):
    """qgZ: the reduce-scatter in two 4-bit all-to-all hops over a (nodes, ranks a node) mesh.

    Args:
        mesh: a 2-D ``DeviceMesh`` (nodes, ranks a node) over the ranks the unit is sharded on,
            in their order: rank i*g + j of the shard group is at (i, j).
        block: elements a scale (even, for two codes a byte).
        weights: the all-gather's policy (default: ``FlatCollectives``'; ``QuantizedWeights()``
            for qwZ and qgZ together).
    """

    def __init__(self, mesh, block: int = BLOCK, weights: FlatCollectives | None = None):
        if mesh.ndim != 2:
            raise ValueError(f"QuantizedGradients needs a 2-D mesh (nodes, ranks a node), got "
                             f"{mesh.ndim}-D")
        if block < 2 or block % 2:
            raise ValueError(f"block must be an even number of elements, got {block}")
        self.nodes, self.per_node = mesh.shape
        self.intra, self.inter = mesh.get_group(1), mesh.get_group(0)
        i, j = mesh.get_coordinate()
        self.position = i * self.per_node + j
        self.block, self.weights = block, weights or FlatCollectives()
        self.in_place_ok = getattr(self.weights, "in_place_ok", True)
        ledger.name_group(self.intra, "intra-node")
        ledger.name_group(self.inter, "inter-node")

    def __repr__(self) -> str:
        return (f"QuantizedGradients(mesh={self.nodes}x{self.per_node}, block={self.block}, "
                f"weights={type(self.weights).__name__})")

    def all_gather(self, *args, **kwargs):
        return self.weights.all_gather(*args, **kwargs)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, S) -> (R, nb*B/2) uint8, two 4-bit codes a byte, and (R, nb) fp32 scales."""
        q, scale = quantize_rows(x, self.block, LEVELS)
        return pack(q), scale

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, size: int) -> torch.Tensor:
        return dequantize_rows(unpack(packed), scale, size)

    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str):
        n, g = self.nodes, self.per_node
        if backend.world_size(group) != n * g or backend.rank(group) != self.position:
            raise ValueError(
                f"QuantizedGradients' mesh ({n}x{g}) must hold the ranks the unit is sharded "
                f"over, in their order: this rank is {backend.rank(group)} of "
                f"{backend.world_size(group)} there and at {self.position} in the mesh. Shard "
                "over the mesh's ranks (group=None for a mesh of the world)")
        if op not in ("sum", "avg"):
            raise ValueError(f"QuantizedGradients reduces by sum or avg, not {op!r}")
        size = grad.numel() // (n * g)
        # [node i', local j', element] -> [local j', node i', element]: chunk j' is contiguous
        rows = grad.view(n, g, size).transpose(0, 1).reshape(g * n, size).float()
        q, scale = self.quantize(rows)
        works = _exchange(q, scale, self.intra, unit, phase)
        return _SecondHop(self, works, grad, slot, size, op, n * g, unit, phase)


def _exchange(q, scale, group, unit, phase):
    """Both all-to-alls in flight: (received codes, received scales, their handles)."""
    q_in, s_in = torch.empty_like(q), torch.empty_like(scale)
    w1 = collectives.all_to_all(q_in.view(-1), q.view(-1), group=group, unit=unit, phase=phase,
                                async_op=True)
    w2 = collectives.all_to_all(s_in.view(-1), scale.view(-1), group=group, unit=unit,
                                phase=phase, async_op=True)
    return q_in, s_in, (w1, w2)


class _SecondHop:
    """Hop 1 in flight; ``wait()`` sums it, runs hop 2, and leaves the shard in ``grad[slot]``."""

    def __init__(self, policy, works, grad, slot, size, op, world, unit, phase):
        self.policy, self.works, self.grad, self.slot = policy, works, grad, slot
        self.size, self.op, self.world, self.unit, self.phase = size, op, world, unit, phase

    def wait(self):
        p, size = self.policy, self.size
        n, g = p.nodes, p.per_node
        q_in, s_in, works = self.works
        for w in works:
            w.wait()
        # From each local rank, its n shards {i'*g + j} (ours among them): the node's part of
        # each, summed in fp32 in local-rank order, the same on every rank.
        node_part = p.dequantize(q_in, s_in, size).view(g, n, size).sum(dim=0)
        q2, s2 = p.quantize(node_part)
        q2_in, s2_in, works = _exchange(q2, s2, p.inter, self.unit, self.phase)
        for w in works:
            w.wait()
        total = p.dequantize(q2_in, s2_in, size).sum(dim=0)  # every node's part of our shard
        if self.op == "avg":
            total /= self.world
        self.grad[self.slot].copy_(total)
        self.works = self.grad = None
