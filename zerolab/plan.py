"""``python -m zerolab plan``: which system does *my* model need on *my* cluster, and what will it cost?

For each system (DDP, ZeRO-1/2/3, FSDP2 with and without resharding; with ``--systems`` also
our stage 3 with CPU offload, as HSDP, with hpZ, qwZ or qgZ) the plan trains one step of rank 0 of a *fake* process
group of N ranks under ``FakeTensorMode``: the real ``zero.shard`` (or torch's
``fully_shard``) on the real model, every tensor a shape and a dtype without memory, every
collective recorded but moving nothing. What it reports, per rank:

- memory, measured by the trackers ``benchmarks/compare_stages.py`` measures real runs with
  (``zerolab.trackers``), on the second step (the optimizer state exists by then): the model
  states (parameters + gradients + optimizer state at their largest, units in flight
  included), and the peak of everything, activations and temporaries too;
- bytes sent, with the ledger's ring accounting: our ``zero.Ledger`` for ours (with the
  flags a fake group skips: see ``simulate``; not the ranks' few bytes of agreement), torch's
  collectives counted at the dispatcher (``zerolab.measure.CommBytes``) for FSDP2, and for DDP
  (whose reducer cannot run on fake tensors) an all-reduce of every fp32 gradient, in DDP's
  buckets, which its peak counts too (a flat copy of the gradients, held from wrapping on);
- time: the collectives priced by ``zerolab.cost`` (alpha-beta rings, no overlap) plus the
  step's FLOPs (torch's ``FlopCounterMode``) at the preset's rated dense throughput
  (``zerolab.clusters``). Real steps reach 30-60% of a rated figure, and the model overlaps
  nothing: the predicted time is a bound to compare systems by, not a forecast.

The units are the model's repeated blocks (``zerolab.planmodel.repeated_blocks``: the children
of a ``ModuleList`` that are all of one class), each one unit, and the root holding the rest.
When the blocks are alike (one list, every block the same parameter shapes) the plan runs the
model cut to 3 and to 4 blocks and extends each figure along the line through the two: a
block adds the same bytes, collectives and FLOPs wherever it sits. Memory is a maximum, not
a sum, so the step is cut into pieces where each block begins (``_Segments``), each piece is
extended on its own (the first two blocks', the last two's, those outside the blocks) and the
largest taken. ``--exact`` runs every block instead (``notes/19-plan.md`` compares the two).

    python -m zerolab plan --model benchmarks/configs/llama-3-8b.json --world-size 64 \\
        --cluster dgx-h100 --mixed-precision --batch 1 --seq 4096 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import namedtuple

import torch
import torch.distributed as dist

import zero
from zerolab.clusters import PRESETS, preset
from zerolab.cost import step_time
from zerolab.measure import _OPS, CommBytes, _group_size, _size
from zerolab.planmodel import PlanError, Planned, build, fake_safe
from zerolab.trackers import (MODEL_STATES, PeakFSDPMemTracker, PeakMemTracker,
                              ZeroMemTracker)

SYSTEMS = ("ddp", "zero1", "zero2", "zero3", "fsdp2-noreshard", "fsdp2")
FAMILY = ("zero3-offload", "zero3-hsdp", "zero3-hpz", "zero3-qwz", "zero3-qgz")
MULTI_NODE = ("zero3-hsdp", "zero3-hpz", "zero3-qgz")  # need 2 nodes or more
# The simulation's bounds. Fake tensors cost per operation, not per byte: a module holding
# parameters costs about 20 ms per system on 2 cores whatever its width (a 70B Llama's 80
# blocks run whole in 15-40 s a system; measured 2026-12-03), so what is simulated (every
# module, or with alike blocks all but the blocks past the 4th) is bounded by modules. A fake
# rank costs ~70 bytes (benchmarks/simulate.py measured it).
MAX_MODULES, MAX_WORLD_SIZE = 2000, 1_000_000
SAMPLE = (3, 4)  # the depths simulated when the blocks are alike
DDP_BUCKETS = (1 << 20, 25 << 20)  # DDP's first bucket, then every other (bucket_cap_mb=25)
Call = namedtuple("Call", "op buffer_bytes sent_bytes group ranks")  # what cost.step_time reads


class CommCalls(CommBytes):
    """``CommBytes`` that also keeps each collective, for the cost model."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.calls_list: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _OPS:
            name, arg, factor = _OPS[func]
            n, full = _group_size(func, args, self.n), _size(args[arg], True)
            self.calls_list.append(Call(name, full, int(full * factor * (n - 1) / n), "world", n))
        return out


class _NoModuleStats:
    """MemTracker walks every module's statistics after every operation; the plan reads only
    the totals (as ``ZeroMemTracker(per_module=False)``), so keep the device peak alone."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


class _DDPTracker(_NoModuleStats, PeakMemTracker):
    pass


class _FSDPTracker(_NoModuleStats, PeakFSDPMemTracker):
    pass


def ddp_calls(grad_bytes: int, n: int, buffer_bytes: dict[str, int] | None = None) -> list[Call]:
    """DDP's all-reduces: every gradient once, in buckets (sizes as its reducer makes them);
    and, before each forward, rank 0's module buffers broadcast to the others, flattened one
    dtype at a time (``broadcast_buffers=True``, its default)."""
    calls = [Call("broadcast", b, int(b * (n - 1) / n), "world", n)
             for b in (buffer_bytes or {}).values() if b]
    left, cap = grad_bytes, DDP_BUCKETS[0]
    while left > 0:
        b = min(cap, left)
        calls.append(Call("all_reduce", b, int(2 * b * (n - 1) / n), "world", n))
        left, cap = left - b, DDP_BUCKETS[1]
    return calls


def _meshes(kind: str, n: int, gpus_per_node: int) -> dict:
    """The device meshes a system needs, made outside FakeTensorMode (they run collectives)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind.startswith("fsdp2"):
        return {"mesh": init_device_mesh("cpu", (n,))}
    if kind in MULTI_NODE:
        mesh = init_device_mesh("cpu", (n // gpus_per_node, gpus_per_node),
                                mesh_dim_names=("replicate", "shard"))
        return {"zero3-hsdp": {"mesh": mesh}, "zero3-hpz": {"secondary_group": mesh.get_group(1)},
                "zero3-qgz": {"comm_policy": zero.QuantizedGradients(mesh)}}[kind]
    if kind == "zero3-qwz":
        return {"comm_policy": zero.QuantizedWeights()}
    if kind == "zero3-offload":
        return {"offload_policy": _HostOnMeta(pin_memory=False)}
    return {}


HOST = torch.device("meta")


class _HostOnMeta(zero.CPUOffload):
    """CPU offload with the host on the meta device. The plan's device is (fake) CPU, so the
    host must be another device for the tracker to keep the two memories apart: the shards,
    their gradients and the optimizer state live there, fake tensors all the same, and every
    copy between the two is the one a GPU run makes (the ledger's h2d and d2h records)."""

    def home(self, compute: torch.device) -> torch.device:
        return HOST

    def to_host(self, shard: torch.Tensor, unit: str, keep: bool = False) -> torch.Tensor:
        zero.comm.ledger.record_copy("d2h", shard, unit, "backward")
        return torch.empty(shard.shape, dtype=shard.dtype, device=HOST).copy_(shard)


def _wrap(kind: str, model: Planned, mp: bool, kw: dict) -> None:
    """Shard ``model`` as ``zerolab.systems.System`` does: each unit, the root last."""
    if kind == "ddp":
        return
    if kind.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp else MixedPrecisionPolicy()
        for unit in model.units():
            rafa = ({"reshard_after_forward": False}
                    if kind == "fsdp2-noreshard" and unit is not model else {})
            fully_shard(unit, mp_policy=policy, **kw, **rafa)
        return
    policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    for unit in model.units():
        zero.shard(unit, stage=int(kind[4]), mp_policy=policy, **kw)


def _figures(mt) -> dict:
    """What the tracker saw since its last reset: the peak total and its categories, and the
    model states (for ours also the ZeRO paper's split: each state at its own persistent peak,
    stage 3's gathered units and a unit's full gradient left out as transient)."""
    dev = torch.device("cpu")
    peaks = mt.get_tracker_snapshot("peak")
    snap = peaks.get(dev, {})
    out = {"peak": {str(getattr(k, "value", k)): v for k, v in snap.items()},
           "states": mt.category_peaks.get(dev, {}).get(MODEL_STATES, 0),
           "host": {str(getattr(k, "value", k)): v for k, v in peaks.get(HOST, {}).items()}}
    if isinstance(mt, ZeroMemTracker):
        out["paper"] = {str(getattr(k, "value", k)): v for k, v in mt.state_peaks.items()}
    return out


def _reset(mt) -> None:
    """Start the tracker's peaks again from what is held now (a new phase of the step)."""
    mt.category_peaks.clear()
    mt._peak_mem.clear()
    mt._peak_mem_snap.clear()
    if isinstance(mt, ZeroMemTracker):
        mt.state_peaks.clear()
        mt.transient_peak = 0


class _Segments:
    """The step cut where blocks begin (forward: a block's pre-hook; backward: the gradient
    of its output arriving), each piece's figures kept apart: ``out[(phase, where)]``, where
    is "head", "tail" or a block's index. A block's figures are affine in its index and the
    depth, so the largest over blocks is at the first or the last blocks: that is what lets a
    shallow model's figures be extended to a deep one."""

    def __init__(self, mt, model: Planned):
        self.mt, self.key, self.out, self.handles = mt, ("forward", "head"), {}, []
        blocks = [model.inner.get_submodule(b) for b in model.block_names]
        for j, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(
                lambda m, args, j=j: self._enter(j, args, first=j == 0)))
            self.handles.append(block.register_forward_hook(
                lambda m, args, out, j=j: self._leave(j, out, last=j == len(blocks) - 1)))

    def _enter(self, j, args, first):
        self.cut(("forward", j))
        x = _tensor(args)
        if first and x is not None and x.requires_grad:  # backward leaves the blocks here
            x.register_hook(lambda g: self.cut(("backward", "tail")))

    def _leave(self, j, out, last):
        y = _tensor(out)
        if y is not None and y.requires_grad:  # block j's backward begins here
            y.register_hook(lambda g: self.cut(("backward", j)))
        if last:
            self.cut(("forward", "tail"))

    def cut(self, key) -> None:
        f = _figures(self.mt)
        was = self.out.get(self.key)
        self.out[self.key] = f if was is None else _most(was, f)
        _reset(self.mt)
        self.key = key

    def remove(self):
        for h in self.handles:
            h.remove()


def _tensor(x):
    """The first tensor of a module's input or output (HF layers may return tuples)."""
    if torch.is_tensor(x):
        return x
    if isinstance(x, (tuple, list)):
        return next((t for t in x if torch.is_tensor(t)), None)
    return None


def _most(a: dict, b: dict) -> dict:
    """Figures of two pieces taken as one: each figure's larger."""
    top = a if a["peak"].get("Total", 0) >= b["peak"].get("Total", 0) else b
    out = {"peak": top["peak"], "states": max(a["states"], b["states"]),
           "host": max(a["host"], b["host"], key=lambda h: h.get("Total", 0))}
    if "paper" in a:
        out["paper"] = {k: max(a["paper"].get(k, 0), b["paper"].get(k, 0))
                        for k in {*a["paper"], *b["paper"]}}
    return out


def _canon(segments: dict, depth: int) -> dict:
    """Pieces named so that a run at one depth lines up with a run at another: a block by its
    place from the start (first two) and from the end (last two); the others are between
    them, and their figures (affine in the index) never exceed both ends'."""
    out = {}
    for (phase, where), f in segments.items():
        if isinstance(where, str):
            out[(phase, where)] = f
            continue
        names = ([("first", where)] if where < 2 else []) + \
                ([("last", depth - 1 - where)] if where >= depth - 2 else [])
        for name in names:
            out[(phase, *name)] = f
    return out


def simulate(spec: str, kind: str, n: int, batch: int, seq: int, mp: bool = False,
             checkpoint: bool = False, gpus_per_node: int = 8, flops: bool = False,
             blocks: int | None = None, wrap: str | None = None) -> dict:
    """One training step of rank 0 of ``n`` for ``kind`` on fake tensors (``blocks``: the
    model cut to its first that many blocks): per phase what it held, and what it sent."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.flop_counter import FlopCounterMode

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        kw = _meshes(kind, n, gpus_per_node)
        with FakeTensorMode(), fake_safe():
            model = build(spec, checkpoint, seq, wrap)
            if blocks is not None:
                model.keep_blocks(blocks)
            model.seq = seq
            _wrap(kind, model, mp and kind != "ddp", kw)  # DDP stays fp32, as compare_stages'
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            gen = torch.Generator().manual_seed(0)
            x, y = model.batch(batch, gen)
            # The first step: the optimizer state exists after it. Its FLOPs and FSDP2's
            # collectives are every step's, counted here, not in the measured step: torch's
            # FlopCounterMode and CommDebugMode keep tensors alive that the step would free
            # (with checkpointing, DDP's peak read 1.68x the measured one under the first, a
            # BERT's every peak a hidden state high under the second)
            fc = FlopCounterMode(display=False) if flops else _Nothing()
            with fc, CommCalls(n) as comm:
                model.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if kind == "ddp":
                mt = _DDPTracker()
                mt.track_external(model, opt)
            elif kind.startswith("fsdp2"):
                mt = _FSDPTracker(model, opt)
            else:
                mt = ZeroMemTracker(model, opt, per_module=False)
            with mt, zero.Ledger() as ledger:
                seg = _Segments(mt, model)
                loss = model.loss(model(x), y)
                seg.cut(("backward", "head"))
                loss.backward()
                seg.cut(("step", "all"))
                opt.step()
                opt.zero_grad()
                seg.cut(None)
                seg.remove()
        grad_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        buffer_bytes: dict[str, int] = {}
        for b in model.buffers():
            buffer_bytes[str(b.dtype)] = buffer_bytes.get(str(b.dtype), 0) + b.nbytes
    finally:
        dist.destroy_process_group()
    if kind == "ddp":
        calls = ddp_calls(grad_bytes, n, buffer_bytes)
        sent = sum(c.sent_bytes for c in calls)
    elif kind.startswith("fsdp2"):
        calls, sent = comm.calls_list, comm.total()
    else:
        calls, sent = list(ledger.records), ledger.sent_bytes()
    # A fake group skips what compares ranks: our "used" flags, one byte a parameter
    # all-reduced at the end of every backward (zero/core/root.py), are added by that rule
    # (in _row); the agreements (zero/comm/agree.py, a few bytes) are left out
    flags = sum(len(u.params) for u in zero.units_of(model)) if kind.startswith("zero") else None
    return {"flags": flags, "segments": seg.out, "depth": len(model.block_names), "sent": sent,
            "by_op": _by_op(calls), "calls": calls,
            "host_copies": sum(r.buffer_bytes for r in ledger.records if r.op in ("h2d", "d2h")),
            "grad_bytes": grad_bytes, "buffer_bytes": buffer_bytes, "flops": fc.get_total_flops() if flops else None}


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _by_op(calls) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        out[c.op] = out.get(c.op, 0) + c.sent_bytes
    return out


def _extend(a, b, depth: int):
    """The value at ``depth`` blocks on the line through ``a`` (at SAMPLE[0] blocks) and ``b``
    (at SAMPLE[1], one more): numbers, or dicts of them, key by key (a missing key is 0)."""
    if isinstance(b, dict) or isinstance(a, dict):
        return {k: _extend((a or {}).get(k, 0), (b or {}).get(k, 0), depth)
                for k in {*(a or {}), *(b or {})}}
    return b + (b - a) * (depth - SAMPLE[1])


def _row(runs: list[dict], kind: str, depth: int, n: int, cluster) -> dict:
    """One system's figures at ``depth`` blocks from one run (exact) or two (SAMPLE)."""
    if len(runs) == 1:
        at = lambda f: f(runs[0])  # noqa: E731
    else:
        at = lambda f: _extend(f(runs[0]), f(runs[1]), depth)  # noqa: E731
    pieces = [_canon(r["segments"], r["depth"]) for r in runs]
    keys = set(pieces[0]).intersection(*pieces)
    seg = {k: at(lambda r, k=k: pieces[runs.index(r)][k]) for k in keys}
    top = max(keys, key=lambda k: seg[k]["peak"].get("Total", 0))
    row = {
        "system": kind, "world_size": n,
        "model_state_bytes_per_rank": max(seg[k]["states"] for k in keys),
        "peak_bytes_per_rank": seg[top]["peak"].get("Total", 0),
        "peak_phase": top[0],
        "peak_by_category": {c: v for c, v in seg[top]["peak"].items() if c != "Total"},
        "bytes_sent_per_rank_per_step": at(lambda r: r["sent"]),
        "bytes_by_op": at(lambda r: r["by_op"]),
        "comm_s_by_group": at(lambda r: step_time(r["calls"], cluster)),
        "flops_per_rank_per_step": at(lambda r: r["flops"]) if runs[0]["flops"] else None,
    }
    host = max(seg[k]["host"].get("Total", 0) for k in keys)
    if host:  # CPU offload: what the host holds at most, and what crosses PCIe a step
        row["host_bytes_per_rank"] = host
        row["host_device_bytes_per_step"] = at(lambda r: r["host_copies"])
    if all("paper" in seg[k] for k in keys):  # each state at its own peak (simulate.py's)
        cats = {c for k in keys for c in seg[k]["paper"]}
        row["paper_model_state_bytes_per_rank"] = sum(
            max(seg[k]["paper"].get(c, 0) for k in keys) for c in cats)
    if runs[0]["flags"] is not None:  # our "used" flags (see simulate), from the whole model
        flags = at(lambda r: r["flags"])
        call = Call("all_reduce", flags, int(flags * 2 * (n - 1) / n), "world", n)
        row["bytes_sent_per_rank_per_step"] += call.sent_bytes
        row["bytes_by_op"]["all_reduce"] = row["bytes_by_op"].get("all_reduce", 0) + call.sent_bytes
        for group, t in step_time([call], cluster).items():
            row["comm_s_by_group"][group] = row["comm_s_by_group"].get(group, 0.0) + t
    if kind == "ddp":  # DDP's traffic: its buckets over the whole model's gradients
        grads = at(lambda r: r["grad_bytes"])
        calls = ddp_calls(grads, n, at(lambda r: r["buffer_bytes"]))
        row.update(bytes_sent_per_rank_per_step=sum(c.sent_bytes for c in calls),
                   bytes_by_op=_by_op(calls), comm_s_by_group=step_time(calls, cluster))
        # and its memory: the buckets, a flat fp32 copy of every gradient that DDP allocates
        # when it wraps the model (gradient_as_bucket_view=False, its default) and keeps
        row["peak_bytes_per_rank"] += grads
        row["peak_by_category"]["DDP buckets"] = grads
    return row


def check(spec: str, n: int, checkpoint: bool, exact: bool, seq: int,
          wrap: str | None = None) -> dict:
    """Build MODEL on the meta device and hold it to the simulation's bounds: what it is."""
    if n > MAX_WORLD_SIZE:
        raise PlanError(f"--world-size {n}: the simulation's bound is {MAX_WORLD_SIZE:,} ranks "
                        f"(its fake process group keeps ~70 bytes a rank)")
    with torch.device("meta"), fake_safe():
        model = build(spec, checkpoint, seq, wrap)
    longest = model.max_positions()
    if longest is not None and seq > longest:
        raise PlanError(f"--seq {seq}: the model embeds positions for {longest} tokens at most; "
                        f"pass --seq {longest} or less")
    repeat = model.repeat()
    out = {"params": sum(p.numel() for p in model.parameters()),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "blocks": len(model.block_names), "block_list": repeat["list"],
           "alike": repeat["alike"], "block_class": repeat["class"]}
    out["units"] = len(model.units())
    # a wrap policy's units need not follow the blocks (a size policy may join or split
    # them, and its choice near the root depends on depth): such a plan runs every block
    out["extend"] = out["alike"] and not exact and not wrap and out["blocks"] > SAMPLE[1]
    # What the simulation costs: its operations, about in proportion to the modules that hold
    # parameters (~20 ms each per system on 2 cores, whatever their size)
    owners = lambda m: sum(1 for x in m.modules() if any(True for _ in x.parameters(False)))  # noqa: E731
    cost = owners(model)
    if out["extend"]:
        cost -= (out["blocks"] - SAMPLE[1]) * owners(model.inner.get_submodule(model.block_names[0]))
    if cost > MAX_MODULES:
        if exact and out["alike"]:
            why, fix = "--exact runs every block", "leave out --exact (alike blocks are " \
                "simulated at 3 and 4 and extended)"
        elif out["blocks"]:
            why, fix = "its blocks differ (in class or parameter shapes), so the plan runs every " \
                "one", "plan a config with fewer layers and scale by hand"
        else:
            why, fix = "it has no repeated blocks (the children of an nn.ModuleList, all of one " \
                "class), so the plan runs all of it", "hold the repeated layers in an nn.ModuleList"
        raise PlanError(f"--model: the simulation would run {cost:,} modules with parameters, "
                        f"beyond its bound of {MAX_MODULES:,} (about 20 ms each per system): "
                        f"{why}; {fix}")
    return out


def plan(args) -> tuple[dict, list[dict]]:
    """What MODEL is, and every system's row, cheapest that fits first."""
    p = preset(args.cluster, args.memory_gb, args.tflops, args.intra_gbs, args.inter_gbs,
               args.gpus_per_node)
    gpn = p.cluster.ranks_per_node
    info = check(args.model, args.world_size, args.activation_checkpointing, args.exact,
                 args.seq, args.wrap_policy)
    depths = SAMPLE if info["extend"] else (None,)
    rows, flops = [], None
    for kind in args.systems:
        if kind in MULTI_NODE and (args.world_size % gpn or args.world_size // gpn < 2):
            continue  # one node (or ranks that do not fill nodes): nothing to split over
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = [simulate(args.model, kind, args.world_size, args.batch, args.seq,
                             args.mixed_precision, args.activation_checkpointing, gpn,
                             flops=flops is None, blocks=d, wrap=args.wrap_policy)
                    for d in depths]
        r = _row(runs, kind, info["blocks"], args.world_size, p.cluster)
        flops = r["flops_per_rank_per_step"] if flops is None else flops
        compute = flops / (p.tflops(args.mixed_precision) * 1e12)
        r.update(flops_per_rank_per_step=flops, compute_s=compute,
                 predicted_step_s=compute + r["comm_s_by_group"]["total"],
                 fits=r["peak_bytes_per_rank"] <= p.memory_bytes,
                 simulated_s=round(time.monotonic() - start, 2))
        rows.append(r)
        if args.verbose:
            print(f"{kind}: simulated in {r['simulated_s']:.1f} s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (not r["fits"], r["predicted_step_s"]))
    return info, rows


def predict(model: str, systems, world_size: int, batch: int, seq: int,
            mixed_precision: bool = False, cluster: str = "dgx-h100",
            wrap: str | None = None, checkpoint: bool = False) -> list[dict]:
    """The plan's rows for these systems, as ``benchmarks/compare_stages.py --model`` asks."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, "--world-size", str(world_size), "--batch",
                              str(batch), "--seq", str(seq), "--cluster", cluster])
    args.mixed_precision, args.systems = mixed_precision, list(systems)
    args.wrap_policy, args.activation_checkpointing = wrap, checkpoint
    return plan(args)[1]


def table(info: dict, rows: list[dict], args) -> list[str]:
    p = preset(args.cluster, args.memory_gb, args.tflops, args.intra_gbs, args.inter_gbs,
               args.gpus_per_node)
    how = ("simulated at 3 and 4 blocks and extended (they are alike)" if info["extend"] else
           "every block simulated")
    units = (f"{info['blocks']} blocks ({info['block_class']} in {info['block_list']}), one unit "
             f"each, and the root with the rest" if info["blocks"] else
             "no repeated blocks: one unit, the whole model")
    if getattr(args, "wrap_policy", None):
        units = (f"{info['units']} units by the wrap policy {args.wrap_policy} (the last the root "
                 f"with the rest)")
    r0 = rows[0]
    out = [f"Model {args.model}: {info['params']:,} parameters; {units}; {how}.",
           f"Batch {args.batch} x seq {args.seq} per rank"
           f"{', bf16 compute, fp32 master and reduction (DDP: fp32)' if args.mixed_precision else ', fp32'}"
           f"{', activation checkpointing' if args.activation_checkpointing else ''}; "
           f"{args.world_size} ranks.",
           f"Cluster: {p.cluster.name}; {p.memory_bytes / 1e9:g} GB a GPU; "
           f"{p.tflops(args.mixed_precision):g} TFLOPS rated ({p.source}).",
           f"Compute: {r0['flops_per_rank_per_step'] / 1e12:.4g} TFLOP a rank a step = "
           f"{r0['compute_s']:.3g} s at the rated throughput.", "",
           "| system | fits | model states GB | peak GB (phase) | sent GB/step | comm s | "
           "step s (no overlap) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['system']} | {'yes' if r['fits'] else 'no'} | "
                   f"{r['model_state_bytes_per_rank'] / 1e9:.3f} | "
                   f"{r['peak_bytes_per_rank'] / 1e9:.3f} ({r['peak_phase']}) | "
                   f"{r['bytes_sent_per_rank_per_step'] / 1e9:.3f} | "
                   f"{r['comm_s_by_group']['total']:.4f} | {r['predicted_step_s']:.4f} |")
    for r in rows:
        if "host_bytes_per_rank" in r:
            out.append(f"\n{r['system']}: the host holds {r['host_bytes_per_rank'] / 1e9:.3f} GB a rank "
                       f"(the shards, their gradients, the optimizer state), and "
                       f"{r['host_device_bytes_per_step'] / 1e9:.3f} GB cross between host and "
                       f"device a step (in comm s); the columns are the device's.")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a Hugging Face config.json (or its folder), torchtitan:NAME:FLAVOR "
                        "(torchtitan:llama3:8B), or package.module:callable returning an "
                        "nn.Module")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--cluster", choices=sorted(PRESETS), default="dgx-h100")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override the preset's")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory a GPU (GB, 1e9)")
    p.add_argument("--tflops", type=float, default=None, help="rated TFLOPS a GPU")
    p.add_argument("--intra-gbs", type=float, default=None, help="GB/s a GPU within a node")
    p.add_argument("--inter-gbs", type=float, default=None, help="GB/s a GPU across nodes")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 master")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward")
    p.add_argument("--wrap-policy", default=None, metavar="POLICY",
                   help="units by an FSDP1 auto-wrap policy, transformer:Class[,Class] or size:N "
                        "(runs every block), not the model's repeated blocks")
    p.add_argument("--exact", action="store_true",
                   help="simulate every block, not 3 and 4 blocks extended")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {SYSTEMS + FAMILY}, or 'all'")
    p.add_argument("--json", default=None, metavar="FILE", help="one object per system")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="model states and peak per system against the device's memory")
    p.add_argument("--verbose", action="store_true", help="each system's simulation time")


def run(args, parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand: a table on stdout; bad input exits 2 with one line."""
    args.systems = list(SYSTEMS + FAMILY) if args.systems == "all" else args.systems.split(",")
    bad = [s for s in args.systems if s not in SYSTEMS + FAMILY]
    if bad:
        parser.error(f"--systems: unknown {bad}; choose from {SYSTEMS + FAMILY}")
    for name, v in (("--world-size", args.world_size), ("--batch", args.batch),
                    ("--seq", args.seq), ("--gpus-per-node", args.gpus_per_node or 1)):
        if v < 1:
            parser.error(f"{name} must be >= 1, got {v}")
    try:
        info, rows = plan(args)
    except PlanError as e:
        parser.exit(2, f"error: {e}\n")
    print("\n".join(table(info, rows, args)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"params": info["params"], **r} for r in rows], f, indent=1)
    if args.plot:
        plot(rows, args, args.plot)


def plot(rows: list[dict], args, path: str) -> None:
    """Two bars a system (model states, peak), GB, and the device's memory as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = preset(args.cluster, args.memory_gb, args.tflops, args.intra_gbs, args.inter_gbs,
                    args.gpus_per_node).memory_bytes / 1e9
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
    ax.bar([i - 0.2 for i in x], [r["model_state_bytes_per_rank"] / 1e9 for r in rows], 0.4,
           label="model states")
    ax.bar([i + 0.2 for i in x], [r["peak_bytes_per_rank"] / 1e9 for r in rows], 0.4,
           label="peak")
    ax.axhline(memory, color="k", linestyle="--", label=f"device memory ({memory:g} GB)")
    ax.set_xticks(list(x), [f"{r['system']}\n{r['predicted_step_s']:.3g} s" for r in rows],
                  fontsize=8)
    ax.set_ylabel("GB per rank")
    ax.set_title(f"{args.model}, {args.world_size} ranks (step time: no overlap)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
