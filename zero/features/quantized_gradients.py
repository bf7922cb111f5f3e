"""ZeRO++'s qgZ: the gradient reduce-scatter as two all-to-alls of 4-bit blocks (Wang et al.,
"ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", 2023,
section 3.3).

qgZ quantizes once per level of the cluster, not at each hop of a ring, and sums in fp32 between:
with N = n nodes x g ranks a node, hop 1 is an all-to-all in the node (to local rank j, the n
shards it owns, as 4-bit blocks), hop 2 one across nodes (the node's part of shard i'*g + j to
node i'). Drawn, with bytes and the error bound (a block's largest magnitude over 14, each hop):
notes/17-family.md, "qgZ".
"""

from __future__ import annotations

import torch

from zero import api
from zero.comm.flat_collectives import FlatCollectives
from zero.features.quantized import dequantize_rows, quantize_rows

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
        mesh: a 2-D ``DeviceMesh`` (nodes, ranks a node) over the unit's shard group, in order.
        block: elements a scale (even, for two codes a byte).
        weights: the all-gather's policy (``QuantizedWeights()`` for qwZ too).
    """

    def __init__(self, mesh, block: int = BLOCK, weights: FlatCollectives | None = None):
        if mesh.ndim != 2:
            raise ValueError(f"QuantizedGradients needs a 2-D mesh (nodes, ranks a node), got "
                             f"{mesh.ndim}-D")
        if block < 2 or block % 2:
            raise ValueError(f"block must be an even number of elements, got {block}")
        self.nodes, self.per_node = mesh.shape
        self.ranks = mesh.mesh.flatten().tolist()
        # (every rank holds the same mesh: these checks fail on all of them alike)
        if self.ranks != sorted(self.ranks):
            raise ValueError(f"QuantizedGradients needs the mesh's ranks in rank order, node by "
                             f"node ({self.ranks} is not): rank i*g + j of the shard group is "
                             "local rank j of node i, the order the unit's shards are in")
        if mesh.get_coordinate() is None:
            raise ValueError(f"this rank ({mesh.get_rank()}) is not in QuantizedGradients' mesh "
                             f"{self.ranks}: build the policy on the ranks of the mesh only")
        self.intra, self.inter = mesh.get_group(1), mesh.get_group(0)
        self.block, self.weights = block, weights or FlatCollectives()
        self.in_place_ok = self.weights.in_place_ok

    def __repr__(self) -> str:
        return (f"QuantizedGradients(mesh={self.nodes}x{self.per_node}, block={self.block}, "
                f"weights={type(self.weights).__name__})")

    def all_gather(self, *args, **kwargs):
        return self.weights.all_gather(*args, **kwargs)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, S) -> (R * (nb*B/2 + 4*nb),) uint8: each row's 4-bit codes, then its scales."""
        q, scale = quantize_rows(rows, self.block, LEVELS)
        r = rows.shape[0]
        return torch.cat([pack(q), scale.view(torch.uint8).view(r, -1)], dim=1).view(-1)

    def decode(self, message: torch.Tensor, r: int, size: int) -> torch.Tensor:
        """A message of ``r`` rows -> (r, size) fp32."""
        nb = -(-size // self.block)
        rows = message.view(r, -1)
        codes, scales = rows[:, : nb * self.block // 2], rows[:, nb * self.block // 2:]
        return dequantize_rows(unpack(codes), scales.contiguous().view(torch.float32), size)

    def message_bytes(self, r: int, size: int) -> int:
        nb = -(-size // self.block)
        return r * (nb * self.block // 2 + 4 * nb)

    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str, ctx: api.Comm) -> api.Work:
        n, g = self.nodes, self.per_node
        sharded_over = [ctx.backend.global_rank(group, r) for r in range(ctx.world_size(group))]
        if sharded_over != self.ranks:  # (the same answer on every rank of the group)
            raise ValueError(
                f"QuantizedGradients' mesh ({n}x{g}, ranks {self.ranks}) must hold the ranks the "
                f"unit is sharded over, in their order ({sharded_over}). Shard over the mesh's "
                "ranks (group=None for a mesh of the world)")
        if op not in ("sum", "avg"):
            raise ValueError(f"QuantizedGradients reduces by sum or avg, not {op!r}")
        size = grad.numel() // (n * g)
        shards = grad.view(n, g, size)  # [node i', local j', element]: shard i'*g + j'
        send = torch.empty(g, self.message_bytes(n, size), dtype=torch.uint8, device=grad.device)
        for j in range(g):  # to local rank j: the n shards it owns (one chunk at a time, so
            send[j] = self.encode(shards[:, j, :])  # that no copy of the whole gradient is made)
        recv = torch.empty_like(send)
        ctx.name_group(self.intra, "intra-node")  # (for the ledger)
        ctx.name_group(self.inter, "inter-node")
        work = ctx.all_to_all(recv.view(-1), send.view(-1), group=self.intra, unit=unit,
                              phase=phase, async_op=True)
        return _SecondHop(self, work, recv, grad, slot, size, op, unit, phase, ctx)


class _SecondHop:
    """Hop 1 in flight; ``wait()`` sums it, runs hop 2, and leaves the shard in ``grad[slot]``."""

    def __init__(self, policy: QuantizedGradients, work: api.Work, recv: torch.Tensor,
                 grad: torch.Tensor, slot: slice, size: int, op: str, unit: str, phase: str,
                 ctx: api.Comm):
        self.policy, self.work, self.recv, self.grad, self.slot = policy, work, recv, grad, slot
        self.size, self.op, self.unit, self.phase, self.ctx = size, op, unit, phase, ctx

    def wait(self):
        p, size = self.policy, self.size
        n, g = p.nodes, p.per_node
        self.work.wait()
        # Each local rank's part of our n shards {i'*g + j}: the node's sum, fp32, in rank order.
        node_part = torch.zeros(n, size, dtype=torch.float32, device=self.grad.device)
        for j in range(g):
            node_part += p.decode(self.recv[j], n, size)
        send = p.encode(node_part)  # row i' (shard i'*g + j) to node i'
        recv = torch.empty_like(send)
        self.ctx.all_to_all(recv, send, group=p.inter, unit=self.unit, phase=self.phase)
        total = torch.zeros(size, dtype=torch.float32, device=self.grad.device)
        for part in recv.view(n, -1):  # every node's part of our shard, in node order
            total += p.decode(part, 1, size)[0]
        if self.op == "avg":
            total /= n * g
        self.grad[self.slot].copy_(total)
        del self.work, self.recv, self.grad  # (they go)
