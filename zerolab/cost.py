"""How long a step's communication takes on a cluster: the ledger's bytes, an alpha-beta model.

Each collective runs as a ring over the ranks of its group: an all-gather or a reduce-scatter
takes p - 1 steps and sends (p - 1)/p of the buffer from every rank, an all-reduce twice
that. A step costs a latency alpha, a byte costs 1/beta; beta is the slowest link the ring
crosses: NVLink if all its ranks are on one node, the network if it spans nodes:

    time = steps * alpha + sent_bytes / beta

An all-reduce that spans nodes pays the latency of NCCL's tree instead (a chain within each
node, a binary tree across): 2 x (ranks per node - 1 + log2 nodes) steps instead of the ring's
2 x (p - 1), at the same bandwidth (either sends about twice the buffer from every rank).
All-gathers and reduce-scatters run as rings (NCCL has no tree for them). Not modelled:
contention between concurrent collectives, NVLink SHARP (NVLS), and the bandwidth a
collective loses to the compute it overlaps. When the collectives overlap computation is
``zerolab/overlap.py``'s question; this file only prices each one.

    cluster = Cluster("8 x H100 per node, NVLink 4, 4 x 200 Gb/s IB", ranks_per_node=8,
                      intra_gbs=450, inter_gbs=12.5)
    seconds = step_time(ledger.records, cluster)
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

# One collective as the cost model reads it (a ledger record has the same fields)
Call = namedtuple("Call", "op buffer_bytes sent_bytes group ranks")

STEPS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "broadcast": 1, "agree": 1,
         "all_to_all": 1}  # (p - 1 pairwise exchanges, (p - 1)/p of the buffer sent)


@dataclass(frozen=True)
class Cluster:
    """Per-rank link bandwidths (GB/s, 1e9 bytes) and per-step latencies (microseconds)."""

    name: str
    ranks_per_node: int
    intra_gbs: float  # within a node (NVLink), per GPU
    inter_gbs: float  # across nodes (InfiniBand / RoCE), per GPU
    intra_alpha_us: float = 5.0
    inter_alpha_us: float = 10.0
    host_gbs: float = 25.0  # host <-> device, per GPU (PCIe 4 x16, about 25 GB/s each way)
    host_alpha_us: float = 10.0
    disk_gbs: float = 3.0  # memory <-> a local NVMe drive, per GPU (a 4-drive RAID0 for 8 GPUs)
    # host memory a GPU's share of: a DGX H100's 2 x 8 channels of DDR5-4800 (614 GB/s) / 8
    host_memory_gbs: float = 77.0


def collective_time(op: str, sent_bytes: float, ranks: int, crosses_nodes: bool,
                    cluster: Cluster) -> float:
    """Seconds for one collective that sends ``sent_bytes`` from each rank (ring accounting)."""
    if ranks <= 1:
        return 0.0
    alpha = (cluster.inter_alpha_us if crosses_nodes else cluster.intra_alpha_us) * 1e-6
    beta = (cluster.inter_gbs if crosses_nodes else cluster.intra_gbs) * 1e9
    steps = STEPS[op] * (ranks - 1)
    if op == "all_reduce" and crosses_nodes and ranks > cluster.ranks_per_node:
        nodes = -(-ranks // cluster.ranks_per_node)
        steps = min(steps, 2 * (cluster.ranks_per_node - 1 + math.ceil(math.log2(nodes))))
    return steps * alpha + sent_bytes / beta


def crosses_nodes(group: str, ranks: int, cluster: Cluster) -> bool:
    """A group named "intra-node" stays in a node; any other spans nodes when it has more
    ranks than a node (our flat groups place consecutive ranks on one node, as torchrun does)."""
    return group != "intra-node" and (group == "inter-node" or ranks > cluster.ranks_per_node)


def record_time(r, cluster: Cluster) -> float:
    """Seconds for one ledger record (or anything with its fields: op, buffer_bytes,
    sent_bytes, group, ranks): a collective, a copy between host and device at the host link's
    bandwidth (CPU offload's), or a read or write of the disk (disk offload's)."""
    if r.op in ("h2d", "d2h"):
        return cluster.host_alpha_us * 1e-6 + r.buffer_bytes / (cluster.host_gbs * 1e9)
    if r.op in ("read", "write"):
        return r.buffer_bytes / (cluster.disk_gbs * 1e9)
    return collective_time(r.op, r.sent_bytes, r.ranks, crosses_nodes(r.group, r.ranks, cluster),
                           cluster)


def step_time(records, cluster: Cluster) -> dict[str, float]:
    """Seconds of communication per step, by group, and in total, from ledger records (a copy
    between host and device, CPU offload's, at the host link's bandwidth: group "host"; disk
    offload's reads and writes at the disk's: group "disk"), one after another."""
    out: dict[str, float] = {}
    for r in records:
        out[r.group] = out.get(r.group, 0.0) + record_time(r, cluster)
    out["total"] = sum(out.values())
    return out
