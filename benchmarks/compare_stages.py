"""Compare DDP, ZeroRedundancyOptimizer, ZeRO-1/2/3 (ours) and FSDP2 side by side:
per-rank memory by category, bytes sent per step, and step time, beside the ZeRO paper.

    python benchmarks/compare_stages.py              # small GPT, 2 CPU ranks (gloo), ~1 min
    python benchmarks/compare_stages.py --sweep      # 3 sizes x world sizes 1, 2, 4
    torchrun --nproc-per-node 8 benchmarks/compare_stages.py --device cuda   # NCCL

Every system trains the same model from the same seed on the same data with AdamW. Memory
is measured by torch's MemTracker (FSDPMemTracker for FSDP2, zerolab.trackers.ZeroMemTracker for
ours), bytes at the dispatcher (zerolab.measure.CommBytes, a dispatch mode as torch's
CommDebugMode; for ours it is checked against our ledger), time as the median of the timed
steps (slowest rank per step).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py: tables, results file, plots)
from argtypes import comma_list, int_in, output_file, positive_int  # noqa: E402

import zero  # noqa: E402
from zerolab.memory import model_state_bytes, schedule  # noqa: E402
from zerolab.measure import CommBytes  # noqa: E402
from zerolab.trackers import (  # noqa: E402
    MODEL_STATES, MODEL_STATES_AND_COMM, PeakFSDPMemTracker, PeakMemTracker, ZeroMemTracker)
from zerolab.models import GPT, GPTConfig, LoRAStack  # noqa: E402
from zerolab.systems import FAMILY, KINDS, WRAPS, System, stage_of  # noqa: E402

# ---- defaults (a small GPT that runs in about a minute on 2 CPU cores) ---------------------
WORLD_SIZE, LAYERS, DIM, SEQ, BATCH, VOCAB, HEADS = 2, 4, 128, 64, 8, 512, 4
# --frozen: fine-tuning, LoRA-style (frozen dim x dim base and a trainable rank-8 adapter per block)
FROZEN_LAYERS, FROZEN_DIM, LORA_RANK = 8, 384, 8
STEPS, WARMUP = 12, 2
# --targets (issue 46's, emulated): the default GPT and one of 35.7M parameters (20 blocks of
# 384: zerolab.systems.gpt_35m), at 2 and 4 ranks, on one H100 node and on two
BIG = (20, 384)
BIG_STEPS = 3  # its steps take about 1.3 s of one core each
TARGET_NETWORKS = ["dgx-h100", "dgx-h100:2-nodes"]
TARGET_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "fsdp2-noreshard", "fsdp2"]
TARGET_WORLD_SIZES = [2, 4]
MAX_LOCAL_RANKS = 64  # local ranks are processes sharing this machine's cores and memory
MAX_STEPS = 1000  # a system's ranks have 600 s (run_ranks' timeout); the median settles long before
SWEEP_SIZES = [(2, 64), (4, 128), (4, 256)]  # (layers, dim): 0.12M to 3.3M parameters
SWEEP_WORLD_SIZES = [1, 2, 4]
SWEEP_KINDS = ["ddp", "zero1", "zero2", "zero3"]
PAPER_STAGE = {"ddp": 0, "ddp+zro": 1, "zero1": 1, "zero2": 2, "zero3": 3,
               "fsdp2-noreshard": 2, "fsdp2": 3, "zero3-offload": 3, "zero3-disk": 3,
               "zero3-qwz": 3, "zero3-qgz": 3}


def measure(rank: int, n: int, kind: str, args, time_only: bool = False) -> dict:
    """Train one system on this rank; return its losses, bytes, memory and step times (only
    the losses and step times with ``time_only``: a later round). With ``--network`` the run
    is recorded for the emulated cluster (zerolab/emulate.py): each timed step's log."""
    if not getattr(args, "network", None):
        return _measure(rank, n, kind, args, time_only, None)
    from zerolab.clusters import PRESETS
    from zerolab.emulate import Recorder

    # (the system is built inside: its streams are emulated); every operator is also priced on
    # the first network's GPU by the roofline, for the roofline's clock
    device = PRESETS[args.network[0].partition(":")[0]].device
    clock = "kernels" if args.clock == "roofline" else args.clock
    with Recorder(clock, device=device) as recorder:
        return _measure(rank, n, kind, args, time_only, recorder)


def _measure(rank: int, n: int, kind: str, args, time_only: bool, recorder) -> dict:
    local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's: this rank's GPU on its node
    device = torch.device(args.device, local % max(1, torch.cuda.device_count())) \
        if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    base = make_model(args).to(device)
    variant = getattr(args, "variants", {}).get(kind)
    if variant is not None:  # a schedule of someone's own: its zero.shard arguments
        from zerolab.variants import load

        shard = load(variant)
        system = System(kind, base, "adamw", mp=args.mixed_precision, shard=shard)
        system.own_precision = shard.get("mp_policy") is not None  # (compared among its own)
    else:
        layout = {"layout": args.layout, "wrap": args.wrap} if kind.startswith("zero") else {}
        system = System(kind, base, "adamw",
                        mp=args.mixed_precision and kind not in ("ddp", "ddp+zro"), **layout)
    losses = []

    def step(i):
        losses.append(system.step(rank, i, batch=args.batch)[0].item())
        if device.type == "cuda":
            torch.cuda.synchronize()

    buckets = _record_ddp_buckets(system.model) if kind.startswith("ddp") else {}
    for i in range(WARMUP):
        step(i)
    buckets.clear()  # DDP rebuilds its buckets in the second step: keep those it uses now
    if time_only:  # (the same steps, so that every round trains on the same data)
        for i in range(WARMUP, WARMUP + 2):
            step(i)
    else:
        with CommBytes(n) as comm, zero.Ledger() as ledger:  # traffic: one step
            step(WARMUP)
        # memory: one step (trackers slow a step down)
        with _tracker(kind, system, buckets.values()) as mem:
            step(WARMUP + 1)
    times, logs = [], []
    for i in range(WARMUP + 2, WARMUP + 2 + (args.steps if not args.no_time else 0)):
        dist.barrier()
        t0 = time.perf_counter()
        if recorder is not None:
            with recorder.step() as log:
                step(i)
            logs.append(log)
        else:
            step(i)
        times.append(time.perf_counter() - t0)
    if times:  # a step lasts as long as its slowest rank
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    if time_only:
        return {"kind": kind, "losses": losses, "step_times": times, "logs": logs,
                "model_states_peak": 0, "psi": sum(p.numel() for p in base.parameters())}
    peak_snapshot = mem.get_tracker_snapshot("peak").get(device, {})
    return {
        "kind": kind,
        "ours": system.ours,
        "variant": variant,
        "own_precision": getattr(system, "own_precision", False),
        "losses": losses,
        "psi": sum(p.numel() for p in base.parameters()),
        "trainable": sum(p.numel() for p in base.parameters() if p.requires_grad),
        "sent": dict(comm.sent),
        "elements": sum(comm.elements.values()),
        "unaccounted": dict(comm.unknown),
        "ledger": ledger.sent_bytes(),
        "agreements": ledger.sent_bytes("agree"),
        "buffers": {op: sum(r.buffer_bytes for r in ledger.select(op)) for op in
                    ("all_gather", "reduce_scatter")},
        "counts": {op: ledger.count(op) for op in ("all_gather", "reduce_scatter", "all_reduce")},
        "memory": {getattr(k, "value", k): v for k, v in peak_snapshot.items()},
        "peaks": {getattr(k, "value", k): v for k, v in mem.category_peaks.get(device, {}).items()},
        "model_states_peak": mem.category_peaks.get(device, {}).get(MODEL_STATES, 0),
        "with_comm_peak": mem.category_peaks.get(device, {}).get(MODEL_STATES_AND_COMM, 0),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_time": statistics.median(times) if times else None,
        "step_times": times,
        "logs": logs,
        "disk": _disk_store(system.opt),
        **_schedule(kind, system, n, args),
    }


def _disk_store(opt) -> dict | None:
    """Disk offload's own count of the optimizer state it held at once, and what it moves a
    step: its buffers are made on its I/O thread, where MemTracker (one thread's) is blind."""
    stores = zero.features.disk_offload.stores_of(opt)
    if not stores:
        return None
    return {"held": max(s.peak_bytes for s in stores),
            "moved": sum(sum(s.sizes.values()) for s in stores)}


def _schedule(kind, system, n, args) -> dict:
    """zerolab.memory.schedule for our stages: the paper's terms walked through our schedule
    (fp32, every parameter trained: not for --mixed-precision or --frozen)."""
    if not kind.startswith("zero") or args.mixed_precision or args.frozen or system.kind in \
            getattr(args, "variants", {}):  # (a variant's schedule is not the formula's)
        return {}
    units = zero.units_of(system.model)
    return {"schedule": schedule([u.layout.padded_numel for u in units], stage_of(kind), n,
                                 sum(len(u.params) for u in units)),
            "largest_unit": max(u.layout.padded_numel for u in units)}


def make_model(args) -> torch.nn.Module:
    if args.model:  # the plan's reading of MODEL: its blocks as units, token ids as the batch
        from zerolab.planmodel import build

        model = build(args.model, args.activation_checkpointing, seq=args.seq, wrap=args.wrap_policy)
        model.seq = args.seq
        return model
    if args.frozen:
        return LoRAStack(dim=args.dim, blocks=args.layers, rank=LORA_RANK)
    return GPT(GPTConfig(vocab=VOCAB, seq=args.seq, dim=args.dim, layers=args.layers, heads=HEADS))


def _record_ddp_buckets(ddp) -> dict:
    """DDP's flat gradient buckets, as its reducer hands them to a communication hook that then
    all-reduces them as DDP's own does (divide by N, sum). The reducer allocates them in C++ when
    it wraps the model and MemTracker learns of a bucket only when a gradient is first copied
    into it, mid-backward, so a peak before that would be measured without the buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets = {}

    def recording_allreduce(group, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(None, recording_allreduce)
    return buckets


def _tracker(kind, system, buckets=()):
    if system.ours:
        return ZeroMemTracker(system.model, system.opt)
    if kind.startswith("fsdp2"):
        return PeakFSDPMemTracker(system.model, system.opt)
    mt = PeakMemTracker()
    # ZeroRedundancyOptimizer keeps this rank's state in the optimizer it wraps
    mt.track_external(system.model, getattr(system.opt, "optim", system.opt), *buckets)
    return mt


def run_system(kind: str, args, time_only: bool = False) -> dict:
    """Measure one system: in fresh local processes, or in this process under torchrun."""
    if dist.is_initialized():  # torchrun: every rank runs every system in turn
        out = measure(dist.get_rank(), dist.get_world_size(), kind, args, time_only)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out["losses"])
        out["losses_all_ranks"] = everyone
        out["logs_all_ranks"] = [out.pop("logs")]  # (this rank's: each plays its own)
        return out
    from zerolab.launch import run_ranks

    backend = "nccl" if args.device == "cuda" else "gloo"
    results = run_ranks(_quiet_measure, args.world_size, kind, args, time_only, timeout=600,
                        backend=backend)
    # Memory per rank is the largest rank's: ranks need not hold the same (torch's
    # ZeroRedundancyOptimizer gives whole parameters to ranks, unevenly).
    out = max(results, key=lambda r: r["model_states_peak"])
    out["losses_all_ranks"] = [r["losses"] for r in results]
    out["logs_all_ranks"] = [r.pop("logs") for r in results]
    for key in ("rss", "with_comm_peak"):
        if key in out:
            out[key] = max(r[key] for r in results)
    return out


def _quiet_measure(rank, n, kind, args, time_only=False):
    warnings.filterwarnings("ignore")  # trackers' hook warnings, DDP's find_unused note
    return measure(rank, n, kind, args, time_only)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int_in(1, MAX_LOCAL_RANKS), default=WORLD_SIZE,
                   help=f"local ranks, at most {MAX_LOCAL_RANKS} (under torchrun: torchrun's)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help=f"default {LAYERS} ({FROZEN_LAYERS} with --frozen)")
    p.add_argument("--dim", type=positive_int, default=None,
                   help=f"a multiple of {HEADS} (heads); default {DIM} ({FROZEN_DIM} with --frozen)")
    p.add_argument("--seq", type=positive_int, default=SEQ)
    p.add_argument("--batch", type=positive_int, default=BATCH, help="per rank")
    p.add_argument("--steps", type=int_in(0, MAX_STEPS), default=STEPS,
                   help=f"timed steps (after warm-up), at most {MAX_STEPS}")
    p.add_argument("--systems", type=comma_list(KINDS + FAMILY), default=None,
                   help=f"comma list of {KINDS} (the default; with --model, those the plan "
                        f"predicts), or of the rest of the ZeRO family {FAMILY}")
    p.add_argument("--mixed-precision", action="store_true",
                   help="bf16 compute, fp32 reduce (ours and FSDP2; DDP stays fp32)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (gloo) or cuda (nccl, under torchrun)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results file (default benchmarks/results/...)")
    p.add_argument("--sweep", action="store_true", help="memory and bytes vs model size and N")
    p.add_argument("--model", default=None,
                   help="instead of the GPT: a Hugging Face config.json, torchtitan:NAME:FLAVOR or "
                        "package.module:callable (as python -m zerolab plan takes it), measured "
                        "beside the plan's prediction")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   choices=("full", "selective"),
                   help="with --model: each block recomputed in backward, whole (full, the flag "
                        "alone) or by torchtitan's per-op policy (selective), as the plan's flag")
    p.add_argument("--wrap-policy", default=None, metavar="POLICY",
                   help="with --model: units by an FSDP1 auto-wrap policy, as python -m zerolab plan "
                        "takes it (transformer:Class[,Class] or size:N)")
    p.add_argument("--json", default=None, metavar="FILE", type=output_file,
                   help="one object per system: system, model_state_bytes_per_rank, "
                        "peak_bytes_per_rank, bytes_sent_per_rank_per_step (and the plan's)")
    p.add_argument("--frozen", action="store_true",
                   help="fine-tuning: blocks of a frozen base and a trainable low-rank adapter "
                        f"(LoRA, rank {LORA_RANK}), AdamW on the adapters")
    p.add_argument("--no-time", action="store_true", help="skip the timed steps")
    p.add_argument("--wrap", default="units", choices=WRAPS,
                   help="which modules become our units: the model's (one per block), pairs of "
                        "blocks, FSDP1's size-based policy at a threshold, or the root only "
                        "(benchmarks/wrap.py compares them)")
    p.add_argument("--layout", default="flat", choices=["flat", "rows", "whole"],
                   help="our stages' shard layout (notes/16-layouts.md; benchmarks/layouts.py "
                        "compares the three)")
    p.add_argument("--network", type=_networks, default=None, metavar="PRESET[,PRESET...]",
                   help="time every system on an emulated GPU cluster (zerolab/emulate.py): "
                        "collectives priced on a zerolab.clusters preset's links, dilated to this "
                        "CPU's compute, with a GPU's stream semantics; NAME fills a node, "
                        "NAME:2-nodes spreads the ranks over two (e.g. dgx-h100,dgx-h100:2-nodes)")
    p.add_argument("--clock", default="kernels", choices=("kernels", "process", "roofline"),
                   help="with --network: what counts as compute, the CPU time inside aten "
                        "operators (kernels: a GPU's stream, the host's Python left out), all "
                        "of the process's CPU time (process), each operator dilated alike; or "
                        "each operator priced on the GPU by the plan's roofline (roofline: no "
                        "dilation, the same figures every run)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="timing rounds, systems interleaved round by round (default 1; 3 with "
                        "--network); the first also measures memory and bytes")
    p.add_argument("--trace", default=None, metavar="FILE", type=output_file,
                   help="with --network: the emulated timelines, Chrome trace format (Perfetto); "
                        "default: beside the results file, .trace.json")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=module:factory",
                   help="a schedule of your own beside the systems (several: repeat the flag): "
                        "the factory returns a dict of zero.shard arguments, policies included, "
                        "applied to every unit as zero3's are (zerolab/variants.py)")
    p.add_argument("--targets", action="store_true",
                   help="issue 46's targets, emulated, in one results file: the default GPT and "
                        f"a 35.7M one ({BIG[0]} blocks of {BIG[1]}), at 2 and 4 ranks, on "
                        f"{' and '.join(TARGET_NETWORKS)} (or --network), 3 rounds (or --rounds)")
    args = p.parse_args(argv)
    if args.targets:
        args.network = args.network or list(TARGET_NETWORKS)
        args.targets_systems = args.systems
    if args.rounds is None:
        args.rounds = 3 if args.network else 1
    if args.network and (args.sweep or args.no_time or args.device != "cpu"):
        p.error("--network emulates a GPU cluster on the CPU's timed steps: leave out --sweep "
                "and --no-time, and run on --device cpu")
    if args.model and (args.sweep or args.frozen):
        p.error("--model measures that model alone: leave out --sweep and --frozen")
    if args.systems is None:
        from zerolab.plan import SYSTEMS

        args.systems = list(SYSTEMS if args.model else KINDS)
    args.variants = {}
    for text in args.variant:
        from zerolab.variants import load, parse, stage

        try:
            name, spec = parse(text)
            if name in KINDS + FAMILY or name in args.variants:
                raise ValueError(f"--variant {name}: the name is taken; choose another")
            PAPER_STAGE[name] = stage(spec)  # (the paper's columns: the stage it runs)
        except ValueError as e:
            p.error(str(e))
        args.variants[name] = spec
    args.systems = list(args.systems) + [n for n in args.variants if n not in args.systems]
    args.kinds = args.systems
    args.sized = args.layers is not None or args.dim is not None  # (--targets: this size only)
    args.layers = args.layers or (FROZEN_LAYERS if args.frozen else LAYERS)
    args.dim = args.dim or (FROZEN_DIM if args.frozen else DIM)
    if args.frozen and (args.sweep or args.mixed_precision):
        p.error("--frozen runs the fine-tuning model alone: leave out --sweep and --mixed-precision")
    if args.steps < 1 and not args.no_time:
        p.error("--steps must be >= 1 (or pass --no-time)")
    if "zero3-qgz" in args.systems and (args.world_size < 4 or args.world_size % 2):
        p.error(f"zero3-qgz plays nodes of 2 ranks and needs 2 nodes or more: pass "
                f"--world-size 4 (or another even number >= 4), not {args.world_size}")
    if args.dim % HEADS and not args.frozen:
        p.error(f"--dim must be a multiple of the number of heads ({HEADS}), got {args.dim}")
    if args.device == "cuda":  # device_count, not is_available: it asks NVML, not CUDA, so
        # CUDA stays usable in the ranks that run_ranks forks from this process
        missing = ("no CUDA device is available" if torch.cuda.device_count() == 0 else
                   "this torch has no NCCL" if not dist.is_nccl_available() else None)
        if missing:
            p.error(f"--device cuda: {missing} (torch {torch.__version__}); the GPU path runs one "
                    f"rank per GPU under torchrun with NCCL: torchrun --nproc-per-node <GPUs> "
                    f"benchmarks/compare_stages.py --device cuda")
    if args.activation_checkpointing and not args.model:
        p.error("--activation-checkpointing goes with --model (the plan's reading of a model)")
    if args.wrap_policy and (not args.model or args.wrap != "units"):
        p.error("--wrap-policy gives every system the units of a --model; it goes with --model "
                "and without --wrap (which re-wraps ours only)")
    if args.model:
        from zerolab.planmodel import PlanError, build

        try:
            with torch.device("meta"):
                model = build(args.model, seq=args.seq, wrap=args.wrap_policy)
                model.units()  # a policy that names no class of the model is refused here
                args.model_psi = sum(q.numel() for q in model.parameters())
                args.model_vocab = model.vocab
        except PlanError as e:
            p.error(str(e))
    if args.device == "cpu" and not args.sweep and (why := too_big(args)):
        p.error(why)
    return args


def _networks(text: str) -> list[str]:
    """A comma list of emulated networks, each checked (zerolab.emulate.network's forms)."""
    from zerolab.clusters import PRESETS

    specs = [t for t in text.split(",") if t]
    for spec in specs:
        name, _, nodes = spec.partition(":")
        if name not in PRESETS or (nodes and not (nodes.endswith("-nodes")
                                                  and nodes.removesuffix("-nodes").isdigit())):
            raise argparse.ArgumentTypeError(
                f"{spec!r}: a preset of zerolab/clusters.py ({', '.join(PRESETS)}), optionally "
                f"with :K-nodes (the ranks spread over K nodes)")
    return specs


def gpt_params(vocab: int, seq: int, dim: int, layers: int) -> int:
    """Ψ of zerolab.models.GPT without building it: embeddings (the head is tied), final
    norm, and per block qkv, proj, fc, out with biases and two norms."""
    return (vocab + seq + 2) * dim + layers * (12 * dim * dim + 13 * dim)


def too_big(args) -> str | None:
    """Why this run cannot fit this machine's memory, or None. A lower bound, so that it never
    refuses a run that fits: the model states by the ZeRO paper's formula for the most demanding
    system chosen, plus the fp32 logits, on every local rank (one that passes may still run
    out). Without it a run too big for RAM starts its ranks and the kernel kills one, or
    the machine swaps."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))  # torchrun's, or ours
    n = int(os.environ.get("WORLD_SIZE", args.world_size))
    psi = getattr(args, "model_psi", None) or gpt_params(VOCAB, args.seq, args.dim, args.layers)
    vocab = getattr(args, "model_vocab", VOCAB)
    states = max(min(model_state_bytes(psi, n, PAPER_STAGE[k], mp) for mp in (False, True))
                 for k in args.kinds)
    need = local * (states + 4 * args.batch * args.seq * vocab)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return None
    return (f"the run needs at least {need / 1e9:,.1f} GB (Ψ = {psi:,} parameters: model states "
            f"and logits on {local} local ranks) and this machine has {have / 1e9:.1f} GB: "
            f"make the model, the batch or the number of ranks smaller")


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        args.world_size = dist.get_world_size()
    lead = not dist.is_initialized() or dist.get_rank() == 0
    if args.targets:
        return targets(args, argv)
    rows = sweep(args, lead) if args.sweep else compare(args, lead)
    if lead and args.model and not dist.is_initialized():
        args.extra = beside_the_plan(rows, args)
    if lead:
        command = ["benchmarks/compare_stages.py", *(sys.argv[1:] if argv is None else argv)]
        report.write(rows, args, command, PAPER_STAGE)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(getattr(args, "json_rows", None) or [measured(r) for r in rows], f,
                          indent=1)
    if "RANK" in os.environ:  # leave together, and tear the group down before Python exits
        dist.barrier()
        dist.destroy_process_group()


def measured(r: dict) -> dict:
    """A measured row in the plan's terms (its JSON keys)."""
    return {"system": r["kind"], "model_state_bytes_per_rank": r["model_states_peak"],
            "peak_bytes_per_rank": r["memory"].get("Total", 0),
            "bytes_sent_per_rank_per_step": sum(r["sent"].values()),
            # ours: the ledger, less the ranks' agreements (a fake group, the plan's, skips them)
            "ledger_bytes_per_rank_per_step": r["ledger"] if r.get("ours") else None,
            "agreement_bytes_per_rank_per_step": r["agreements"] if r.get("ours")
            else None}


def beside_the_plan(rows: list[dict], args) -> list[str]:
    """The plan's prediction for the same model, ranks, batch and precision, beside each
    measured figure (their ratio); with --json, both, one object per system."""
    from zerolab.plan import FAMILY as PLANNED_FAMILY, SYSTEMS as PLANNED, predict

    # (not CPU offload: on CPU ranks host and device are one memory, which the plan splits)
    kinds = [r["kind"] for r in rows if r["kind"] in PLANNED + PLANNED_FAMILY
             and r["kind"] != "zero3-offload"]
    predicted = {r["system"]: r for r in predict(args.model, kinds,
                                                 args.world_size, args.batch, args.seq,
                                                 args.mixed_precision,
                                                 wrap=args.wrap_policy,
                                                 checkpoint=args.activation_checkpointing)}
    out = ["", "## Beside the plan (python -m zerolab plan, the same model on fake ranks)", "",
           "MiB per rank; bytes sent per rank per step (counted at the dispatcher, ring "
           "accounting); predicted / measured. The plan counts our one agreement a step by rule "
           "(its fake group skips it); ZERO_CHECK=1 agrees before every collective, so the "
           "last column compares the measured ledger and the prediction both less their "
           "agreements.", "",
           "| system | model states: measured | predicted | ratio | peak: measured | predicted "
           "| ratio | bytes sent: measured | predicted | ratio | ledger less agreements |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    both = []
    for r in rows:
        m, p = measured(r), predicted.get(r["kind"])
        if p is None:
            continue
        cells = []
        for key, unit in (("model_state_bytes_per_rank", 2**20), ("peak_bytes_per_rank", 2**20),
                          ("bytes_sent_per_rank_per_step", 1)):
            fmt = (lambda v: f"{v / unit:.3f}") if unit > 1 else (lambda v: f"{v:,}")  # noqa: E731
            ratio = p[key] / m[key] if m[key] else float("nan")
            cells += [fmt(m[key]), fmt(p[key]), f"{ratio:.4f}"]
        if m["ledger_bytes_per_rank_per_step"] is not None:  # both less the agreements
            ledger = m["ledger_bytes_per_rank_per_step"] - m["agreement_bytes_per_rank_per_step"]
            less = p["bytes_sent_per_rank_per_step"] - p["agreement_bytes_per_rank_per_step"]
            cells.append(f"{ledger:,} ({'=' if ledger == less else '≠'})")
        else:
            cells.append("-")
        out.append(f"| {r['kind']} | " + " | ".join(cells) + " |")
        both.append({**m, "predicted": {k: p.get(k, 0) for k in (
            "model_state_bytes_per_rank", "peak_bytes_per_rank", "bytes_sent_per_rank_per_step",
            "agreement_bytes_per_rank_per_step", "predicted_step_s")}})
    args.json_rows = both
    return out


def compare(args, lead: bool) -> list[dict]:
    """Every system, round after round (``--rounds``): the first measures everything, the
    others time the steps again, interleaved, so that a drift of the machine's load reaches
    every system alike. With ``--network``, every round's logs played on each network."""
    rows: dict[str, dict] = {}
    rounds = getattr(args, "rounds", 1)
    for r in range(rounds):
        for i, kind in enumerate(args.kinds):
            start = time.monotonic()
            out = run_system(kind, args, time_only=r > 0 or getattr(args, "time_only", False))
            row = rows.setdefault(kind, out)
            row.setdefault("rounds", []).append({"times": out["step_times"],
                                                 "logs": out.pop("logs_all_ranks")})
            if lead:
                of = f" round {r + 1}/{rounds}" if rounds > 1 else ""
                print(f"[{i + 1}/{len(args.kinds)}]{of} {kind}: done in "
                      f"{time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
    for row in rows.values():  # the median over every round's steps
        times = [t for rnd in row["rounds"] for t in rnd["times"]]
        row["step_time"] = statistics.median(times) if times else None
    out = list(rows.values())
    if getattr(args, "network", None) and lead:
        emulated(out, args)
    return out


def emulated(rows: list[dict], args) -> None:
    """Play every round's logs on each ``--network``: row["emulated"][spec] per round, and
    args.emulation (the dilation, its two terms, the networks) for the report."""
    from zerolab import emulate
    from zerolab.clusters import PRESETS

    model = make_model(args)
    threads = max(1, (os.cpu_count() or 1) // args.world_size)  # as zerolab/launch.py's ranks
    roofline = args.clock == "roofline"
    cpu = emulate.cpu_step_seconds(model, args.batch, threads,
                                   clock="kernels" if roofline else args.clock)
    args.emulation = {"cpu_step_s": cpu, "networks": {}, "clock": args.clock}
    for spec in args.network:
        preset = PRESETS[spec.partition(":")[0]]
        gpu = emulate.gpu_step_seconds(model, args.batch, preset.device, args.mixed_precision)
        dilation = 1.0 if roofline else cpu / gpu
        net = emulate.network(spec, args.world_size, dilation=dilation)
        args.emulation["networks"][spec] = {"gpu_step_s": gpu, "dilation": dilation,
                                            "cpu_gpu": cpu / gpu, "cluster": net.cluster.name,
                                            "network": net}
        gpu_net = emulate.network(spec, args.world_size)  # (the roofline's clock: undilated)
        for row in rows:
            row.setdefault("emulated", {})[spec] = [
                emulate.summarize(rnd["logs"], gpu_net if roofline else net,
                                  "roofline" if roofline else "cpu") for rnd in row["rounds"]]
            row.setdefault("emulated_roofline", {})[spec] = [
                emulate.summarize(rnd["logs"], gpu_net, "roofline") for rnd in row["rounds"]]
    runs: dict = {}  # the plan's simulations, one a system, played on each network
    for spec, info in args.emulation["networks"].items():
        info["plan"] = plan_exposed(args, spec, info["network"], runs)


def plan_spec(args) -> str | None:
    """The plan's name for the model measured (python -m zerolab plan --model), if it has one."""
    if args.model:
        return args.model
    if args.frozen or (args.seq, args.dim) != (SEQ, DIM) and (args.layers, args.dim) != BIG:
        return None
    if (args.layers, args.dim, args.seq) == (LAYERS, DIM, SEQ):
        return "zerolab.planmodel:gpt_small"  # (the same GPT: vocabulary 512, 4 heads)
    if (args.layers, args.dim, args.seq) == (*BIG, SEQ):
        return "zerolab.systems:gpt_35m"
    return None


def plan_exposed(args, spec: str, net, runs: dict) -> dict:
    """The plan's step for each system on the same model, ranks, batch and links: simulated on
    fake ranks (zerolab/plan.py) and played by zerolab/steptime.py, without the roofline's
    "contention" effect (compute slowed beside a collective), which the emulation does not
    have; "exposed_all_effects_s" with it."""
    from dataclasses import replace

    from zerolab import plan, steptime
    from zerolab.clusters import PRESETS

    model = plan_spec(args)
    if model is None:
        return {}
    preset = replace(PRESETS[spec.partition(":")[0]], cluster=net.cluster)
    effects = tuple(e for e in getattr(steptime, "EFFECTS", ()) if e != "contention")
    out = {}
    for kind in args.kinds:
        if kind not in plan.SYSTEMS:
            continue
        try:
            if kind not in runs:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    runs[kind] = plan.simulate(model, kind, args.world_size, args.batch, args.seq,
                                               args.mixed_precision)
            mine = steptime.step_time(runs[kind], kind, preset, args.mixed_precision,
                                      effects=effects)
            every = steptime.step_time(runs[kind], kind, preset, args.mixed_precision)
            out[kind] = {"exposed_comm_s": mine["exposed_comm_s"], "step_s": mine["step_s"],
                         "exposed_all_effects_s": every["exposed_comm_s"]}
        except Exception as e:  # the plan is another file's: say what it said, go on
            out[kind] = {"error": f"{type(e).__name__}: {e}"[:160]}
    return out


def targets(args, argv=None) -> None:
    """Issue 46's targets, emulated, in one run and one results file: every configuration
    (the default GPT and the 35.7M one, at 2 and 4 ranks) timed round by round and played on
    each network (default: one H100 node, and two)."""
    import copy

    command = ["benchmarks/compare_stages.py", *(sys.argv[1:] if argv is None else argv)]
    sections = []
    models = [((args.layers, args.dim), args.steps)] if args.sized else \
        [((LAYERS, DIM), args.steps), (BIG, min(args.steps, BIG_STEPS))]
    for (layers, dim), steps in models:
        for n in TARGET_WORLD_SIZES:
            a = copy.copy(args)
            a.layers, a.dim, a.world_size, a.steps, a.time_only = layers, dim, n, steps, True
            if args.targets_systems is None:
                a.kinds = a.systems = TARGET_SYSTEMS
            start = time.monotonic()
            rows = compare(a, lead=True)
            print(f"targets: {layers} x {dim} on {n} ranks in {time.monotonic() - start:.0f}s",
                  file=sys.stderr, flush=True)
            sections.append((a, rows))
    if keep := os.environ.get("ZEROLAB_KEEP_RUNS"):  # every log, to render the file again
        import pickle

        with open(keep, "wb") as f:
            pickle.dump((sections, args, command), f)
    report.write_targets(sections, args, command)


def sweep(args, lead: bool) -> list[dict]:
    sizes = [args.world_size] if dist.is_initialized() else SWEEP_WORLD_SIZES  # torchrun: fixed N
    rows, runs = [], [(s, n, k) for s in SWEEP_SIZES for n in sizes for k in SWEEP_KINDS]
    args.no_time = True
    for i, ((layers, dim), n, kind) in enumerate(runs):
        args.layers, args.dim, args.world_size = layers, dim, n
        start = time.monotonic()
        row = run_system(kind, args)
        row.update(layers=layers, dim=dim, world_size=n)
        rows.append(row)
        if lead:
            print(f"[{i + 1}/{len(runs)}] {kind} N={n} psi={row['psi']:,}: "
                  f"{time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    main()
