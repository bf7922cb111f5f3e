"""How much memory per GPU will my model need under each ZeRO stage, on N GPUs?

Answered with our real sharding code, not only a formula: a GPT of about the requested size
is built on the meta device, sharded with ``zero.shard`` as rank R of a *fake* process group
of N ranks, and trained for one step (forward, backward, AdamW) under ``FakeTensorMode``:
every tensor has a shape and a dtype but no memory, and collectives move nothing. torch's
MemTracker (``zerolab.trackers.ZeroMemTracker``) measures what rank R would hold.

    python benchmarks/simulate.py --params 7.5e9 --world-size 64 --stage 1,2,3 --mixed-precision
    python benchmarks/simulate.py --table1            # the ZeRO paper's Table 1, ours beside it
    python benchmarks/simulate.py --table2 --memory 32e9   # the largest model that fits (Table 2)
    python benchmarks/simulate.py --cluster           # memory and communication time side by
                                                      # side, 64-1024 ranks, with HSDP and hpZ

Model states are what the paper counts: parameters (the fp32 master shard, and for stages
1/2 the full compute copy), gradients at their largest (full for stage 1, sharded for 2/3)
and optimizer state. Transient bytes (stage 3's unsharded units, a unit's full gradient
until it is reduced, the upcast reduce buffer) are reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero  # noqa: E402
from argtypes import comma_list, float_in, int_in  # noqa: E402
from zero.surface.meta_init import init_parameters  # noqa: E402
from zerolab.cost import Cluster, crosses_nodes, step_time  # noqa: E402
from zero.comm import Record  # noqa: E402
from zerolab.memory import model_state_bytes  # noqa: E402
from zerolab.trackers import ZeroMemTracker  # noqa: E402
from zerolab.models import GPT, GPTConfig  # noqa: E402

VOCAB, SEQ, BATCH = 50304, 128, 1  # a short sequence: activations are not model states
PAPER_TABLE1 = {  # ZeRO paper, Table 1: 7.5B parameters, K = 12, GB per device, as printed
    4: (52.5, 41.3, 30.0), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88), 1024: (30.1, 15.1, 0.12)}
# Each entry is its formula at Ψ = 7.5e9 rounded as the paper rounds it: at N = 4, stage 2,
# 2 * 7.5 + 14 * 7.5 / 4 = 41.25 is printed 41.3 (notes/09-scale.md, under Table 1).
GB = 1e9
# The command line's bounds: the simulation's own time and memory grow with the layers, about
# 0.09 s and 0.6 MB a layer per stage (2 CPU cores; measured 2026-11-30): 7.5e9 parameters
# (36 layers) take 3 s a stage and 0.35 GB, 2e12 (621 layers; beyond 1.3e12 gpt_config runs
# out of width and only adds layers) a minute a stage and 0.7 GB, 1e15 (310,420 layers) would
# take 7 hours a stage and 190 GB. Memory also grows by about 70 bytes a rank (0.1 GB at a
# million ranks; at a billion the simulation ran out of 24 GB).
MAX_PARAMS, MAX_WORLD_SIZE = 2e12, 1_000_000
MAX_MEMORY = MAX_PARAMS * 16 / 64  # --table2: stage 3 on 64 ranks holds 16 / 64 bytes a parameter


def gpt_config(params: float) -> GPTConfig:
    """A GPT-shaped config (head size 128, width/depth between 40 and 200 as in GPT-2/3)
    with about ``params`` parameters: the widest within 2%, else the closest."""
    options = []
    for dim in (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 12288, 16384):
        per_block = 12 * dim * dim + 13 * dim  # qkv, proj, fc, out with biases, two norms
        layers = max(1, round((params - (VOCAB + SEQ + 2) * dim) / per_block))
        got = layers * per_block + (VOCAB + SEQ + 2) * dim
        shape_penalty = 0 if 40 <= dim / layers <= 200 else 1
        close = abs(got - params) <= 0.02 * params  # within 2%: prefer fewer, wider layers
        options.append((shape_penalty, not close, -dim if close else abs(got - params), dim, layers))
    *_, dim, layers = min(options)
    return GPTConfig(vocab=VOCAB, seq=SEQ, dim=dim, layers=layers, heads=max(1, dim // 128))


def simulate(params: float, world_size: int, stage: int, mixed_precision: bool = False,
             rank: int = 0, hybrid: str | None = None, ranks_per_node: int = 8) -> dict:
    """One training step of rank ``rank`` of ``world_size``, on fake tensors; its memory, and
    the collectives it issued. ``hybrid``: "hsdp" (shard within a node of ``ranks_per_node``
    ranks, replicate across nodes) or "hpz" (stage 3, a secondary shard per node); or the rest
    of the family: "offload" (the shards on the host), "qwz" (int8 weight all-gathers) or "qgz"
    (4-bit gradient reductions in two all-to-all hops, within and across nodes)."""
    cfg = gpt_config(params)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        kw = {}
        if hybrid == "offload":
            kw = {"offload_policy": zero.CPUOffload(pin_memory=False)}
        elif hybrid == "qwz":
            kw = {"comm_policy": zero.QuantizedWeights()}
        elif hybrid == "qgz":  # sharded over the world; the mesh says which ranks share a node
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world_size // ranks_per_node, ranks_per_node))
            kw = {"comm_policy": zero.QuantizedGradients(mesh)}
        elif hybrid:  # a mesh of (nodes, ranks per node), made outside FakeTensorMode
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world_size // ranks_per_node, ranks_per_node),
                                    mesh_dim_names=("replicate", "shard"))
            kw = {"mesh": mesh} if hybrid == "hsdp" else {"secondary_group": mesh.get_group(1)}
        with FakeTensorMode():
            with torch.device("meta"):
                model = GPT(cfg)
            policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mixed_precision else None
            for unit in model.units():
                zero.shard(unit, stage=stage, mp_policy=policy, device="cpu", **kw)
            init_parameters(model)
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randint(0, VOCAB, (BATCH, SEQ))
            with ZeroMemTracker(model, opt, per_module=False) as mt, zero.Ledger() as ledger:
                model.loss(model(x), x).backward()
                opt.step()
        units = zero.units_of(model)
        psi = sum(u.layout.numel for u in units)
    finally:
        dist.destroy_process_group()
    peaks = mt.category_peaks[torch.device("cpu")]
    return {
        "stage": stage, "world_size": world_size, "rank": rank, "params": psi,
        "mixed_precision": mixed_precision, "dim": cfg.dim, "layers": cfg.layers,
        "model_state_bytes_per_rank": mt.model_states_peak,
        "transient_bytes_per_rank": mt.transient_peak,
        "paper_model_state_bytes": model_state_bytes(psi, world_size, stage, mixed_precision),
        "peak_bytes_by_category": {getattr(k, "value", k): v for k, v in peaks.items()},
        "sent_bytes_per_step": ledger.sent_bytes(),
        "records": list(ledger.records),
        # per unit: (padded numel, shard numel, parameters), to check against the formulas
        "units": [(u.layout.padded_numel, u.layout.shard_numel, len(u.params)) for u in units],
    }


def table1() -> list[str]:
    """The paper's Table 1 (7.5B, mixed-precision Adam) beside ours, in GB = 1e9 bytes."""
    out = ["| N | stage | paper GB | ours: model states GB | ours / paper | transient GB |",
           "|---|---|---|---|---|---|"]
    for n, paper in PAPER_TABLE1.items():
        for stage in (1, 2, 3):
            r = simulate(7.5e9, n, stage, mixed_precision=True)
            ours = r["model_state_bytes_per_rank"] / GB
            out.append(f"| {n} | {stage} | {paper[stage - 1]} | {ours:.2f} | "
                       f"{ours / paper[stage - 1]:.3f} | {r['transient_bytes_per_rank'] / GB:.2f} |")
            print(out[-1], file=sys.stderr, flush=True)
    return out


def table2(memory: float, world_sizes=(64,), probe: float = 1e9) -> list[str]:
    """The largest model whose model states fit ``memory`` bytes per device (Table 2, MP = 1).

    Model states grow linearly with Ψ, so one simulation per (stage, N) gives the bytes per
    parameter; a second simulation at the answer checks that it fits.
    """
    out = ["| N | stage | bytes per parameter (measured) | largest Ψ that fits | check: a GPT "
           "near that size, Ψ and model states (GB) | its transient bytes (GB) |",
           "|---|---|---|---|---|---|"]
    for n in world_sizes:
        for stage in (0, 1, 2, 3):
            if stage == 0:  # DDP holds everything: (2 + 2 + 12) bytes per parameter
                out.append(f"| {n} | DDP | 16 | {memory / 16 / 1e9:.2f}B | - | - |")
                continue
            r = simulate(probe, n, stage, mixed_precision=True)
            per_param = r["model_state_bytes_per_rank"] / r["params"]
            fits = memory / per_param
            check = simulate(fits, n, stage, mixed_precision=True)
            out.append(f"| {n} | {stage} | {per_param:.4f} | {fits / 1e9:.2f}B | "
                       f"{check['params'] / 1e9:.2f}B: {check['model_state_bytes_per_rank'] / GB:.2f} | "
                       f"{check['transient_bytes_per_rank'] / GB:.2f} |")
            print(out[-1], file=sys.stderr, flush=True)
    return out


CLUSTERS = {  # per-GPU bandwidths: what one rank's ring can use
    "dgx": Cluster("8 GPUs a node, NVLink 450 GB/s and 8 x 400 Gb/s InfiniBand (50 GB/s) a GPU",
                   ranks_per_node=8, intra_gbs=450, inter_gbs=50),
    "ethernet": Cluster("8 GPUs a node, NVLink 450 GB/s, one 100 Gb/s NIC a node (1.6 GB/s a GPU)",
                        ranks_per_node=8, intra_gbs=450, inter_gbs=12.5 / 8),
}


def cluster_table(params: float, world_sizes, cluster: Cluster) -> list[str]:
    """Memory per rank and predicted communication time per step (zerolab/cost.py), DDP and our
    stages, flat and hybrid, side by side, mixed precision (the paper's K = 12)."""
    out = [f"Cluster: {cluster.name}.", "",
           "| N | system | model states GB | + transient GB | bytes sent GB (in / across "
           "nodes) | comm s/step (intra / inter) |", "|---|---|---|---|---|---|"]
    for n in world_sizes:
        runs = [("DDP", None, 0)] + [(f"ZeRO-{s}", None, s) for s in (1, 2, 3)]
        runs += [(f"HSDP-{s}", "hsdp", s) for s in (1, 2, 3)] + [("hpZ (ZeRO-3)", "hpz", 3)]
        runs += [("ZeRO-3 + CPU offload", "offload", 3), ("ZeRO-3 + disk offload", "disk", 3),
                 ("ZeRO-3 + qwZ", "qwz", 3), ("ZeRO-3 + qgZ", "qgz", 3)]
        for name, hybrid, stage in runs:
            if stage == 0:  # DDP: one all-reduce of the bf16 gradients over every rank
                cfg = gpt_config(params)
                psi = cfg.layers * (12 * cfg.dim**2 + 13 * cfg.dim) + (VOCAB + SEQ + 2) * cfg.dim
                states, transient = model_state_bytes(psi, n, 0, True), 0
                records = [Record("all_reduce", torch.bfloat16, 2 * psi,
                                  int(2 * 2 * psi * (n - 1) / n), "", "backward", 0.0, "world", n)]
            else:
                r = simulate(params, n, stage, True, hybrid="offload" if hybrid == "disk" else hybrid,
                             ranks_per_node=cluster.ranks_per_node)
                states, transient = r["model_state_bytes_per_rank"], r["transient_bytes_per_rank"]
                records = [x for x in r["records"] if x.op != "agree"]
                if hybrid == "disk":  # CPU offload's, and AdamW's two fp32 moments read and
                    # written once a step (the fake tensors cannot go to a file: by the formula)
                    moments = 8 * sum(shard for _, shard, _ in r["units"])
                    records += [Record(op, torch.uint8, moments, 0, "", "step", 0.0, "disk", 1)
                                for op in ("read", "write")]
            t = step_time(records, cluster)
            intra = sum(x.sent_bytes for x in records
                        if not crosses_nodes(x.group, x.ranks, cluster))
            total = sum(x.sent_bytes for x in records)
            out.append(f"| {n} | {name} | {states / GB:.2f} | {transient / GB:.2f} | "
                       f"{intra / GB:.2f} / {(total - intra) / GB:.2f} | "
                       f"{t['total']:.3f} ({t.get('intra-node', 0):.3f} / "
                       f"{t['total'] - t.get('intra-node', 0):.3f}) |")
            print(out[-1], file=sys.stderr, flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float_in(0, MAX_PARAMS), default=7.5e9,
                   help=f"about this many parameters, at most {MAX_PARAMS:g}: the simulation costs "
                        "0.1 s and 0.6 MB a layer per stage (7.5e9: 36 layers; 2e12: 621)")
    p.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=64,
                   help=f"at most {MAX_WORLD_SIZE:,} (the simulation keeps ~70 bytes a rank)")
    p.add_argument("--stage", type=comma_list((1, 2, 3), int), default=[1, 2, 3],
                   help="comma list of stages (1, 2, 3)")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 master")
    p.add_argument("--rank", type=int_in(0), default=0)
    what = p.add_mutually_exclusive_group()  # each prints its own output: one at a time
    what.add_argument("--json", action="store_true", help="print a JSON list, one object per stage")
    what.add_argument("--table1", action="store_true", help="reproduce the ZeRO paper's Table 1")
    what.add_argument("--table2", action="store_true", help="the largest model that fits (Table 2)")
    what.add_argument("--cluster", choices=sorted(CLUSTERS), nargs="?", const="dgx",
                      help="memory and predicted communication time per step, DDP and ZeRO-1/2/3 "
                           "flat and hybrid (HSDP, hpZ), at 64, 256 and 1024 ranks")
    p.add_argument("--memory", type=float_in(0, MAX_MEMORY), default=32e9,
                   help=f"bytes per device for --table2, at most {MAX_MEMORY:g}: stage 3 on 64 "
                        f"ranks fits {MAX_PARAMS:g} parameters in that, --params' bound")
    args = p.parse_args(argv)
    if args.rank >= args.world_size:
        p.error(f"--rank must be in [0, {args.world_size})")
    start = time.monotonic()
    if args.table1 or args.table2:
        lines = table1() if args.table1 else table2(args.memory)
        print("\n".join(lines))
    elif args.cluster:
        print("\n".join(cluster_table(args.params, (64, 256, 1024), CLUSTERS[args.cluster])))
    else:
        rows = [simulate(args.params, args.world_size, s, args.mixed_precision, args.rank)
                for s in args.stage]
        if args.json:
            print(json.dumps([{k: v for k, v in r.items() if k != "records"} for r in rows],
                             indent=1))
        else:
            for r in rows:
                print(f"stage {r['stage']}, N={r['world_size']}, rank {r['rank']}, Ψ={r['params']:,}"
                      f" ({r['layers']} x {r['dim']}): model states "
                      f"{r['model_state_bytes_per_rank'] / GB:.3f} GB (paper formula "
                      f"{r['paper_model_state_bytes'] / GB:.3f}), transient "
                      f"{r['transient_bytes_per_rank'] / GB:.3f} GB")
    print(f"({time.monotonic() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
