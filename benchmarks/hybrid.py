"""What hybrid sharding buys: bytes per link per step, memory per rank, and predicted time.

Four local ranks play two nodes of two ranks. Every system trains the same GPT for a few
steps, and the ledger of one step says what crossed which group: within a node, across
nodes, or the whole world (which spans nodes). Beside each measurement, the formula:

    flat ZeRO-1/2 (world of N)    all-gather + reduce-scatter over all N: 2 (N-1)/N P
    flat ZeRO-3                   + the backward all-gather: 3 (N-1)/N P (less the root's)
    HSDP (R nodes x S per node)   within the node, as flat ZeRO over S; across nodes only
                                  the all-reduce of each rank's gradient shard: 2 (R-1)/R P/S
    hpZ (stage 3, S per node)     forward gathers and the reduce-scatter over all N; the
                                  backward all-gather within the node: (S-1)/S P
    qgZ (stage 3, R x S)          ZeRO-3's gathers over all N; the reduce-scatter as two 4-bit
                                  all-to-alls, per unit of nb blocks a shard (128 elements, 1/2
                                  byte each and 4 bytes a scale: c = 64 nb + 4 nb bytes):
                                  within the node (S-1)/S N c, across (R-1)/R R c

(P: the padded parameters in bytes, fp32 here.) Then zerolab/cost.py turns each step's records
into seconds on a cluster shaped like this run (2 GPUs a node) with DGX-like links, to show the
method; benchmarks/simulate.py --cluster does the same at 64-1024 ranks for a 7.5B model.

    python benchmarks/hybrid.py             # ~30 s on 2 CPU cores
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero  # noqa: E402
from zero.features.quantized_gradients import BLOCK  # noqa: E402
from zerolab.cost import Cluster, step_time  # noqa: E402
from zerolab.launch import run_ranks  # noqa: E402
from zerolab.models import GPT, GPTConfig  # noqa: E402
from zerolab.systems import System  # noqa: E402
from zerolab.trackers import MODEL_STATES, ZeroMemTracker  # noqa: E402

NODES, PER_NODE, STEPS = 2, 2, 3
CONFIG = GPTConfig(vocab=96, seq=32, dim=128, layers=4)
SYSTEMS = {  # name: (kind, System keywords)
    "ZeRO-1": ("zero1", {}), "ZeRO-2": ("zero2", {}), "ZeRO-3": ("zero3", {}),
    "HSDP-1": ("zero1", {"mesh_shape": (NODES, PER_NODE)}),
    "HSDP-2": ("zero2", {"mesh_shape": (NODES, PER_NODE)}),
    "HSDP-3": ("zero3", {"mesh_shape": (NODES, PER_NODE)}),
    "hpZ": ("zero3", {"ranks_per_node": PER_NODE}),
    "qgZ": ("zero3-qgz", {}),
}
CLUSTER = Cluster("2 GPUs a node, NVLink 450 GB/s, InfiniBand 50 GB/s a GPU", ranks_per_node=2,
                  intra_gbs=450, inter_gbs=50)


def _measure(rank, n, kind, kw):
    torch.manual_seed(0)
    sys_ = System(kind, GPT(CONFIG), "adamw", **kw)
    for s in range(STEPS - 1):
        sys_.step(rank, s)
    with zero.Ledger() as ledger, ZeroMemTracker(sys_.model, sys_.opt) as mt:
        losses = sys_.step(rank, STEPS - 1)[0]
    records = [r for r in ledger.records if r.op != "agree"]
    by_group = {}
    for r in records:
        by_group[r.group] = by_group.get(r.group, 0) + r.sent_bytes
    units = zero.units_of(sys_.model)
    return {"by_group": by_group, "states": mt.category_peaks[torch.device("cpu")][MODEL_STATES],
            "time": step_time(records, CLUSTER), "losses": losses.tolist(),
            "padded": sum(u.layout.padded_numel for u in units),
            "root": units[0].layout.padded_numel, "shards": [u.layout.shard_numel for u in units]}


def formula(name: str, padded: int, root: int, shards: list[int]) -> dict[str, float]:
    """Bytes each rank sends per step, by group, for ``padded`` fp32 elements."""
    n, p = NODES * PER_NODE, 4 * padded
    ring = lambda k: (k - 1) / k  # noqa: E731
    stage = int(name[-1]) if name[-1].isdigit() else 3
    gathers = 2 if stage < 3 else 3 - root / padded  # stage 3 gathers again in backward
    if name == "qgZ":
        c = sum(-(-s // BLOCK) * (BLOCK // 2 + 4) for s in shards)  # codes + scales a shard
        return {"world": (gathers - 1) * ring(n) * p, "intra-node": ring(PER_NODE) * n * c,
                "inter-node": ring(NODES) * NODES * c}
    if name.startswith("ZeRO"):
        return {"world": gathers * ring(n) * p}
    if name.startswith("HSDP"):
        return {"intra-node": gathers * ring(PER_NODE) * p,
                "inter-node": 2 * ring(NODES) * p / PER_NODE}
    backward = (1 - root / padded) * p  # hpZ: the root keeps its parameters
    return {"world": 2 * ring(n) * p, "intra-node": ring(PER_NODE) * backward}


def main() -> None:
    rows = {name: run_ranks(_measure, NODES * PER_NODE, kind, kw)[0]
            for name, (kind, kw) in SYSTEMS.items()}
    groups = ["intra-node", "inter-node", "world"]
    print(f"# Hybrid sharding on {NODES} nodes x {PER_NODE} ranks (local, gloo), "
          f"GPT {CONFIG.layers} x {CONFIG.dim}\n")
    print("Bytes each rank sends per step (KiB), measured (ledger) / formula; model states "
          "per rank (MiB); communication time predicted by zerolab/cost.py on "
          f"\"{CLUSTER.name}\" (ms):\n")
    print("| system | " + " | ".join(groups) + " | model states | predicted ms |")
    print("|---" * (len(groups) + 3) + "|")
    for name, r in rows.items():
        want = formula(name, r["padded"], r["root"], r["shards"])
        cells = [f"{r['by_group'].get(g, 0) / 1024:.1f} / {want.get(g, 0) / 1024:.1f}"
                 for g in groups]
        print(f"| {name} | " + " | ".join(cells) +
              f" | {r['states'] / 2**20:.2f} | {1e3 * r['time']['total']:.3f} |")
    def verdict(a, b):
        return "bitwise" if rows[a]["losses"] == rows[b]["losses"] else "not bitwise"
    print(f"\nLosses of the last step (rank 0): hpZ against ZeRO-3: {verdict('hpZ', 'ZeRO-3')}; "
          f"HSDP-3 against ZeRO-3: {verdict('HSDP-3', 'ZeRO-3')} (a mean of means sums in "
          "another order: notes/14-hybrid.md).")


if __name__ == "__main__":
    main()
