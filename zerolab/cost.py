"""How long a step's communication takes on a cluster: the ledger's bytes, priced as NCCL runs them.

Two models, chosen by the cluster:

**NCCL's own tuning model** (a cluster with ``nics_per_node``: every preset of
``zerolab/clusters.py``). NCCL picks, for each collective and size, the algorithm and protocol
its cost model says is fastest (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``); here the same choice, with its constants:

- *bandwidth*: NCCL runs a collective on several channels at once, each a ring through every
  rank. Within a node the channels share NVLink (``intra_gbs``: the ring bus bandwidth that
  nccl-tests measures there); across nodes each channel's ring leaves a node on a different
  NIC, so a node's rings use all its NICs together: the bus bandwidth is the smaller of the
  NVLink figure and ``nics_per_node`` x ``inter_gbs`` x ``net_efficiency`` for the ranks a
  node holds (a group with one rank a node, hpZ's or HSDP's replicas, uses its GPU's NIC
  alone). A ring sends (p - 1)/p of the buffer from every rank (twice for an all-reduce);
  the tree (all-reduce only) reaches 0.92 of the bus bandwidth and moves half of it as
  algorithm bandwidth (``busBw * .92``, ``ratio = .5``);
- *protocols*: Simple at the full bus bandwidth; LL128 at 0.92 of it (120 of every 128 bytes
  are data); LL at half of it, at most ``LL_MAX_GBS`` (NCCL's ``llMaxBws``);
- *latency*: a base per algorithm and protocol, then for a ring a hop's latency per step,
  the NVLink figure for steps within a node and the network's only for the steps that cross
  nodes (nodes - 1 of an all-gather's p - 1); for a tree, 2 x (ranks a node - 1) hops within
  and 2 x log2(nodes) across. A ring all-reduce over several nodes pays its latency 1.4 times
  (NCCL's "plateau effect of ring", Ampere and newer).

The constants (microseconds; NCCL 2.18's ``tuning.cc``, as mirrored in veScale's NCCL emulator,
github.com/volcengine/veScale ``vescale/emulator/nccl/graph/tuning.py``):

    base latency       Tree LL 6.8, LL128 14.0, Simple 0;  Ring LL 6.6, LL128 14.0, Simple 8.4
    hop, NVLink        Tree 0.6, 1.25, 28;                 Ring 0.6, 1.9, 3.4
    hop, network       Tree 5.0, 8.5, 28;                  Ring 2.7, 4.0, 14.0
    LL's ceiling       87.7 GB/s on one node, 22.5 on two, 19.0 on more (Ampere and Hopper)

Not modelled: NVLink SHARP (NVLS) and CollNet, which newer NCCL may pick on hardware that has
them (they are faster: the model is conservative there), contention between two collectives
on the same links, and the bandwidth a collective loses to the compute beside it (the compute
loses some to it: ``zerolab/overlap.py``).

**The plain alpha-beta ring** (a ``Cluster`` without ``nics_per_node``): each collective a
ring of p - 1 steps; a step costs a latency alpha, a byte costs 1/beta, beta the slowest link
the ring crosses (NVLink within one node, else the network, per GPU):

    time = steps * alpha + sent_bytes / beta

with an all-reduce across nodes paying the latency of a tree (a chain within each node, a
binary tree across). ``benchmarks/simulate.py`` and ``benchmarks/hybrid.py`` use it.

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

# NCCL 2.18 tuning.cc (see the module docstring): microseconds, by algorithm and protocol
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_US = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}
HOP_US = {"nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)},
          "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)}}
LL_MAX_GBS = (87.7, 22.5, 19.0)  # llMaxBws: one node, two, more
PROTOCOL_SHARE = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}  # of the bus bandwidth
TREE_SHARE = 0.92  # the tree's bus bandwidth: busBw * .92
RING_PLATEAU = 1.4  # a multi-node ring all-reduce's latency factor (Ampere and newer)
NET_OVERHEAD_US = 3.0  # a step within a node of a multi-node ring: at least this (x86: 1 x 3)


@dataclass(frozen=True)
class Cluster:
    """Link bandwidths (GB/s, 1e9 bytes) and latencies (microseconds).

    With ``nics_per_node`` (NCCL's model): ``intra_gbs`` is the ring bus bandwidth NCCL
    reaches within a node, ``inter_gbs`` one NIC's line rate, ``net_efficiency`` the share
    of it a collective reaches. Without (the alpha-beta ring): both are per GPU, and the
    alphas are the per-step latencies.
    """

    name: str
    ranks_per_node: int
    intra_gbs: float  # within a node (NVLink), per GPU
    inter_gbs: float  # across nodes: per GPU (alpha-beta) or per NIC (NCCL)
    intra_alpha_us: float = 5.0
    inter_alpha_us: float = 10.0
    host_gbs: float = 25.0  # host <-> device, per GPU (PCIe 4 x16, about 25 GB/s each way)
    host_alpha_us: float = 10.0
    disk_gbs: float = 3.0  # memory <-> a local NVMe drive, per GPU (a 4-drive RAID0 for 8 GPUs)
    # host memory a GPU's share of: a DGX H100's 2 x 8 channels of DDR5-4800 (614 GB/s) / 8
    host_memory_gbs: float = 77.0
    nics_per_node: int = 0  # 0: the alpha-beta ring; else NCCL's model over this many NICs
    net_efficiency: float = 1.0  # of a NIC's line rate, in a collective (NCCL's model)


def nodes_of(group: str, ranks: int, cluster: Cluster) -> int:
    """How many nodes a group's ranks sit on: a group named "intra-node" on one, "inter-node"
    one rank a node (hpZ's and HSDP's replicas); any other consecutive ranks, as torchrun
    places them."""
    if group == "intra-node":
        return 1
    if group == "inter-node":
        return ranks
    return -(-ranks // cluster.ranks_per_node)


def bus_gbs(ranks: int, nodes: int, cluster: Cluster) -> float:
    """NCCL's bus bandwidth for a group (GB/s): NVLink's within one node; across nodes the
    node's NICs that its ranks reach (each channel leaves the node on its own NIC), at most
    NVLink's, which every ring also crosses when a node holds more than one of its ranks."""
    if nodes <= 1:
        return cluster.intra_gbs
    per_node = ranks / nodes
    nics = cluster.nics_per_node * min(per_node, cluster.ranks_per_node) / cluster.ranks_per_node
    net = nics * cluster.inter_gbs * cluster.net_efficiency
    return net if per_node <= 1 else min(cluster.intra_gbs, net)


def nccl_time(op: str, buffer_bytes: float, sent_bytes: float, ranks: int, nodes: int,
              cluster: Cluster) -> tuple[float, str]:
    """Seconds for one collective as NCCL's tuning model prices it, and the algorithm and
    protocol it picks ("ring/Simple", ...): the fastest of those NCCL offers for ``op``."""
    if ranks <= 1:
        return 0.0, "none"
    bus = bus_gbs(ranks, nodes, cluster)
    per_node = ranks / nodes
    ll_max = LL_MAX_GBS[min(nodes, 3) - 1]
    best = (math.inf, "")
    for i, proto in enumerate(PROTOCOLS):
        # a ring: the hops within a node at NVLink's latency, the crossings at the network's
        steps, crossings = STEPS[op] * (ranks - 1), STEPS[op] * (nodes - 1)
        within = HOP_US["nvlink"]["ring"][i]
        if nodes > 1:  # a multi-node ring's steps each pay the proxy's network overhead
            within = max(within, NET_OVERHEAD_US * (3 if proto == "Simple" else 1) / 3)
        across = HOP_US["net"]["tree" if per_node <= 1 else "ring"][i]
        latency = BASE_US["ring"][i] + (steps - crossings) * within + crossings * across
        if op == "all_reduce" and nodes > 1 and proto == "Simple":
            latency *= RING_PLATEAU
        bw = min(ll_max, bus * PROTOCOL_SHARE[proto]) if proto == "LL" else \
            bus * PROTOCOL_SHARE[proto]
        best = min(best, (latency * 1e-6 + sent_bytes / (bw * 1e9), f"ring/{proto}"))
        if op != "all_reduce":
            continue
        # a tree (all-reduce only): a chain within each node, a binary tree across
        latency = BASE_US["tree"][i] + 2 * ((per_node - 1) * HOP_US["nvlink"]["tree"][i]
                                            + math.log2(nodes) * HOP_US["net"]["tree"][i])
        share = {"LL": 1 / 3.8, "LL128": 7 / 9 if nodes == 1 else 120 / 128,
                 "Simple": TREE_SHARE}[proto]
        bw = bus * share * 0.5  # algorithm bandwidth: half the bus's
        if proto == "LL":
            bw = min(bw, ll_max * 0.5)
        best = min(best, (latency * 1e-6 + buffer_bytes / (bw * 1e9), f"tree/{proto}"))
    return best


def collective_time(op: str, sent_bytes: float, ranks: int, crosses_nodes: bool,
                    cluster: Cluster) -> float:
    """Seconds for one collective that sends ``sent_bytes`` from each rank (the alpha-beta
    ring; a cluster with NICs is priced by ``nccl_time``, its group on as few nodes as its
    ranks fill)."""
    if ranks <= 1:
        return 0.0
    if cluster.nics_per_node:
        nodes = -(-ranks // cluster.ranks_per_node) if crosses_nodes else 1
        buffer = sent_bytes * ranks / (STEPS[op] * (ranks - 1))
        return nccl_time(op, buffer, sent_bytes, ranks, max(nodes, 2 if crosses_nodes else 1),
                         cluster)[0]
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
    if cluster.nics_per_node and r.ranks > 1:
        return nccl_time(r.op, r.buffer_bytes, r.sent_bytes, r.ranks,
                         nodes_of(r.group, r.ranks, cluster), cluster)[0]
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
