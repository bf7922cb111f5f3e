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
- bytes sent, with the ledger's ring accounting: our ``zero.Ledger`` for ours (with what a
  fake group skips: see ``simulate``), torch's collectives counted at the dispatcher for
  FSDP2, and for DDP (whose reducer cannot run on fake tensors) an all-reduce of every fp32
  gradient, in DDP's buckets, which its peak counts too (a flat copy of the gradients, held
  from wrapping on);
- time on the preset's GPUs (``zerolab/steptime.py``): every operator of the step priced by a
  roofline (``zerolab/roofline.py``: matmuls at the GPU's measured maximum by their tiles'
  waves, attention by formula at FlashAttention-2's measured rate, the rest by bytes at the
  measured memory bandwidth, each kernel at least a launch, at the clocks a stated power limit
  allows), every collective as NCCL's tuning model prices it (``zerolab/cost.py``), the two
  played together as the system's schedule overlaps them, the computation slowed while a
  collective runs (``zerolab/overlap.py``): the step, and the communication left exposed.
  ``--explain`` splits the step by cause, each effect's share (``steptime.explain``).

The units are the model's repeated blocks (``zerolab.planmodel.repeated_blocks``: the children
of a ``ModuleList`` that are all of one class), each one unit, and the root holding the rest.
When the blocks are alike (one list, every block the same parameter shapes) the plan runs the
model cut to 3 and to 4 blocks and extends each figure along the line through the two: a
block adds the same bytes, collectives and FLOPs wherever it sits. Memory is a maximum, not
a sum, so the step is cut into pieces where each block begins (``_Segments``), each piece is
extended on its own (the first two blocks', the last two's, those outside the blocks) and the
largest taken. ``--exact`` runs every block instead (``notes/19-plan.md`` compares the two).

    python -m zerolab plan --model benchmarks/configs/llama-3-8b.json --world-size 64 \\
        --cluster dgx-h100 --mixed-precision --batch 1 --seq 8192 --json plan.json

Needs ``transformers`` for a Hugging Face config, ``torchtitan`` for ``torchtitan:NAME:FLAVOR``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from zerolab import measured, roofline, steptime
from zerolab.clusters import PRESETS, preset
from zerolab.cost import Call, step_time
from zerolab.measure import _OPS, _group_size, _size
from zerolab.planmodel import PlanError, Planned, build, fake_safe
from zerolab.steptime import DDP_BUCKETS
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
# --explain's columns (steptime.explain's keys; "measured" only with --matmul-rates)
CAUSES = {"rated": "rated peak s", "mamf": "matmuls' maximum", "waves": "tile waves",
          "measured": "measured matmuls", "attention": "attention kernel",
          "kernel": "run's own attention", "hbm": "achieved HBM", "launch": "launches",
          "power": "power limit", "contention": "beside collectives",
          "exposed": "exposed comm"}


class StepRecorder(roofline.OpCosts):
    """``roofline.OpCosts`` (every operator's FLOPs and bytes) that also keeps each collective,
    for the cost model, with the unit it served: FSDP2 names it in its ``record_function``
    labels ("FSDP::all_gather (inner.model.layers.3)"; unnamed: the root). ``phase`` is set
    by ``_Segments`` as the step goes."""

    def __init__(self, world_size: int, host: torch.device | None = None):
        super().__init__(host)
        self.n, self.phase = world_size, "forward"
        self.calls: list[tuple[str, str, Call]] = []  # (unit, phase, call), in issue order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _OPS and out is not NotImplemented:
            name, arg, factor = _OPS[func]
            n, full = _group_size(func, args, self.n), _size(args[arg], True)
            call = Call(name, full, int(full * factor * (n - 1) / n), "world", n)
            self.calls.append((self._unit(), self.phase, call))
        return out

    def _unit(self) -> str:
        for label in reversed(self.labels):
            if label.startswith("FSDP::"):
                if " for " in label:  # "FSDP::backward_prefetch for inner.model.layers.2"
                    return label.rpartition(" for ")[2]
                if label.endswith(")") and "(" in label:
                    return label[label.rindex("(") + 1:-1]
                return "root"
        return "root"


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

    def __init__(self, mt, model: Planned, rec: StepRecorder):
        self.mt, self.key, self.out, self.handles = mt, ("forward", "head"), {}, []
        self.rec, self.ops = rec, {}  # each piece's operators (roofline.Op), for its time
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
        self.ops.setdefault(self.key, []).extend(self.rec.take())
        _reset(self.mt)
        self.key = key
        if key is not None:
            self.rec.phase = key[0]

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
             checkpoint: bool | str = False, gpus_per_node: int = 8,
             blocks: int | None = None, wrap: str | None = None) -> dict:
    """One training step of rank 0 of ``n`` for ``kind`` on fake tensors (``blocks``: the
    model cut to its first that many blocks): per piece of the step what it held and the
    operators it ran, and what it sent."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

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
            # The first step: the optimizer state exists after it. The second is measured: its
            # memory by the tracker, its operators and collectives by the recorder, which holds
            # no tensor (torch's FlopCounterMode and CommDebugMode, which track modules, kept
            # tensors alive that the step would free: they once ran in this first step)
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
            rec = StepRecorder(n, HOST if kind == "zero3-offload" else None)
            with mt, zero.Ledger() as ledger, rec:
                seg = _Segments(mt, model, rec)
                loss = model.loss(model(x), y)
                seg.cut(("backward", "head"))
                loss.backward()
                seg.cut(("step", "all"))
                opt.step()
                opt.zero_grad()
                seg.cut(None)
                seg.remove()
        grads = _gradient_pieces(model)
        buffer_bytes: dict[str, int] = {}
        for b in model.buffers():
            buffer_bytes[str(b.dtype)] = buffer_bytes.get(str(b.dtype), 0) + b.nbytes
    finally:
        dist.destroy_process_group()
    grad_bytes = sum(b for _, b in grads)
    start, end = [], []
    if kind == "ddp":
        calls = ddp_calls(grad_bytes, n, buffer_bytes)
        sent, unit_calls = sum(c.sent_bytes for c in calls), []
        start = [c for c in calls if c.op == "broadcast"]
    elif kind.startswith("fsdp2"):
        unit_calls = rec.calls
        calls, sent = [c for _, _, c in unit_calls], sum(c.sent_bytes for _, _, c in unit_calls)
    else:
        calls, sent = list(ledger.records), ledger.sent_bytes()
        unit_calls = [(r.unit, r.phase, r) for r in ledger.records]
    # A fake group skips what compares ranks: our "used" flags, one byte a parameter
    # all-reduced at the end of every backward (zero/core/root.py), and the agreement each
    # forward opens with (zero/comm/agree.py: every rank's 2 int64, all-gathered), are added
    # by those rules (the flags in _row, extended with the blocks; ZERO_CHECK=1 agrees before
    # every collective too: not counted, it is a debugging mode)
    # Both are host metadata (a gloo group where the group moves only device memory): off
    # the device's timeline, as the host's own time is, so nothing exposed for them here.
    flags = sum(len(u.params) for u in zero.units_of(model)) if kind.startswith("zero") else None
    forward = [op for k, ops in seg.ops.items() if k[0] == "forward" for op in ops]
    every = [op for ops in seg.ops.values() for op in ops]
    return {"flags": flags, "segments": seg.out, "depth": len(model.block_names), "sent": sent,
            "by_op": _by_op(calls), "calls": unit_calls, "cost_calls": calls,
            "ops": seg.ops, "block_names": model.block_names, "world_size": n,
            "exposed_start": start, "exposed_end": end, "grads": grads,
            "host_copies": sum(r.buffer_bytes for r in ledger.records if r.op in ("h2d", "d2h")),
            "grad_bytes": grad_bytes, "buffer_bytes": buffer_bytes,
            "flops": roofline.flops(every), "model_flops": roofline.model_flops(forward)}


def _gradient_pieces(model: Planned) -> list[tuple[tuple, int]]:
    """Each trained parameter's fp32 gradient bytes and the piece of backward that forms it
    (``steptime.piece_keys``), in parameter order, for DDP's buckets: a block's in its own
    backward; the root's before the blocks (embeddings) last, the rest (head) first."""
    blocks = {f"inner.{b}.": j for j, b in enumerate(model.block_names)}
    out, seen_block = [], False
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        j = next((j for prefix, j in blocks.items() if name.startswith(prefix)), None)
        seen_block |= j is not None
        where = ("backward", j) if j is not None else \
            ("backward", "head") if seen_block else ("backward", "tail")
        out.append((where, p.numel() * 4))
    return out


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


def _row(runs: list[dict], kind: str, depth: int, n: int, p, mp: bool = False,
         scale: float = 1.0, explain: bool = False) -> dict:
    """One system's figures at ``depth`` blocks from one run (exact) or two (SAMPLE), on the
    preset ``p`` (its GPU's roofline scaled by ``scale``); with ``explain``, the step's
    seconds by cause (``steptime.explain``)."""
    cluster = p.cluster
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
        "comm_s_by_group": at(lambda r: step_time(r["cost_calls"], cluster)),
        "flops_per_rank_per_step": at(lambda r: r["flops"]),
        "model_flops_per_rank_per_step": at(lambda r: r["model_flops"]),
        # the step on the GPU: compute by the roofline, collectives overlapped (steptime.py)
        **at(lambda r: steptime.step_time(r, kind, p, mp, scale)),
    }
    if explain:
        row["step_s_by_cause"] = at(lambda r: steptime.explain(r, kind, p, mp, scale))
    host = max(seg[k]["host"].get("Total", 0) for k in keys)
    if host:  # CPU offload: what the host holds at most, and what crosses PCIe a step
        row["host_bytes_per_rank"] = host
        row["host_device_bytes_per_step"] = at(lambda r: r["host_copies"])
    if all("paper" in seg[k] for k in keys):  # each state at its own peak (simulate.py's)
        cats = {c for k in keys for c in seg[k]["paper"]}
        row["paper_model_state_bytes_per_rank"] = sum(
            max(seg[k]["paper"].get(c, 0) for k in keys) for c in cats)
    if runs[0]["flags"] is not None:  # our "used" flags and agreement (see simulate)
        flags = at(lambda r: r["flags"])
        calls = [Call("all_reduce", flags, int(flags * 2 * (n - 1) / n), "world", n),
                 Call("agree", 16 * n, 16 * (n - 1), "world", n)]
        for call in calls:
            row["bytes_sent_per_rank_per_step"] += call.sent_bytes
            row["bytes_by_op"][call.op] = row["bytes_by_op"].get(call.op, 0) + call.sent_bytes
        for group, t in step_time(calls, cluster).items():
            row["comm_s_by_group"][group] = row["comm_s_by_group"].get(group, 0.0) + t
        row["agreement_bytes_per_rank_per_step"] = calls[1].sent_bytes
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
    out["no_cache"] = getattr(getattr(model.inner, "config", None), "use_cache", None) is False
    out["few_rows"] = _few_rows(model, n)
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


def _few_rows(model: nn.Module, n: int) -> list[tuple[str, tuple, int]]:
    """Parameters with fewer rows (dim 0) than ranks: (name, shape, numel), largest first."""
    out = [(name, tuple(q.shape), q.numel()) for name, q in model.named_parameters()
           if q.dim() and q.shape[0] < n]
    return sorted(out, key=lambda t: -t[2])


def warnings_for(info: dict, systems, n: int) -> list[str]:
    """What the answer hinges on that the table does not show."""
    out = []
    rows = info["few_rows"]
    held = sum(t[2] for t in rows)
    if any(s.startswith("fsdp2") for s in systems) and held > 0.01 * info["params"]:
        shapes = {}
        for name, shape, _ in rows:
            shapes.setdefault(shape, []).append(name)
        some = "; ".join(f"{len(names)} of shape {tuple(shape)} ({names[0]}"
                         f"{', ...' if len(names) > 1 else ''})"
                         for shape, names in list(shapes.items())[:3])
        least = min(t[1][0] for t in rows)
        out.append(f"fsdp2 shards every parameter by rows (dim 0), and {held / info['params']:.0%} "
                   f"of the parameters are in tensors of fewer rows than the {n} ranks: {some}. "
                   f"Each such tensor is padded to {n} rows and a rank holds one row of it, so "
                   f"its share a rank stops falling past {least} ranks and FSDP2's model states "
                   f"grow with N. The fix: fully_shard(..., shard_placement_fn=lambda p: "
                   f"Shard(1) if p.shape[0] < {n} else None) (torchtitan shards experts so), "
                   f"or zero's flat layout (zero.shard, the default), which pads only each unit "
                   f"to a multiple of N.")
    return out


def _preset(args):
    """The preset with the command line's overrides, and the measured matmul rates of
    ``--matmul-rates`` on its GPU (``zerolab/measured.py``) where given."""
    from dataclasses import replace

    p = preset(args.cluster, args.memory_gb, args.tflops, args.intra_gbs, args.inter_gbs,
               args.gpus_per_node, getattr(args, "attention_kernel", None))
    path = getattr(args, "matmul_rates", None)
    if path is None:
        return p
    rates = measured.load(path, args.model, args.batch, args.seq, args.mixed_precision,
                          args.activation_checkpointing)
    return replace(p, device=replace(p.device, matmul_rates=rates))


def _measured_warnings(p, rows: list[dict], args) -> list[str]:
    """What measured matmul rates leave to the model: shapes not in the file, another GPU."""
    rates = p.device.matmul_rates
    if rates is None:
        return []
    out = []
    family = p.device.name.split()[0]
    if family not in rates.device:
        out.append(f"--matmul-rates: measured on {rates.device}, and the preset's GPU is "
                   f"{p.device.name}: its rates stand in for the preset's")
    short = [r for r in rows if r.get("matmul_flops") and
             r["matmul_flops_measured"] < (1 - 1e-9) * r["matmul_flops"]]
    if short:
        some = ", ".join(f"{r['system']} "
                         f"{100 * r['matmul_flops_measured'] / r['matmul_flops']:.0f}%"
                         for r in short)
        fix = measured.command(args.model, args.batch, args.seq, args.mixed_precision,
                               args.activation_checkpointing)
        out.append(f"--matmul-rates: the file lacks some of this step's matmul shapes, which "
                   f"keep the MAMF-and-tiles rate (share of the matmul FLOPs measured: {some}; "
                   f"DDP computes in fp32, another batch or sequence has other shapes); to "
                   f"measure them: {fix}")
    return out


def plan(args) -> tuple[dict, list[dict]]:
    """What MODEL is, and every system's row, cheapest that fits first."""
    p = _preset(args)
    gpn = p.cluster.ranks_per_node
    info = check(args.model, args.world_size, args.activation_checkpointing, args.exact,
                 args.seq, args.wrap_policy)
    depths = SAMPLE if info["extend"] else (None,)
    info["warnings"] = warnings_for(info, args.systems, args.world_size)
    rows = []
    for kind in args.systems:
        if kind in MULTI_NODE and (args.world_size % gpn or args.world_size // gpn < 2):
            info["warnings"].append(f"{kind} left out: it splits ranks into nodes of {gpn}, and "
                                    f"{args.world_size} ranks are not 2 or more full nodes")
            continue
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = [simulate(args.model, kind, args.world_size, args.batch, args.seq,
                             args.mixed_precision, args.activation_checkpointing, gpn,
                             blocks=d, wrap=args.wrap_policy)
                    for d in depths]
        r = _row(runs, kind, info["blocks"], args.world_size, p, args.mixed_precision,
                 args.efficiency, getattr(args, "explain", False))
        tokens = args.batch * args.seq
        r.update(predicted_step_s=r["step_s"], tokens_per_s_per_gpu=tokens / r["step_s"],
                 model_flops_per_token=r["model_flops_per_rank_per_step"] / tokens,
                 mfu=r["model_flops_per_rank_per_step"] / r["step_s"]
                 / (p.tflops(args.mixed_precision) * 1e12),
                 fits=r["peak_bytes_per_rank"] <= p.memory_bytes,
                 simulated_s=round(time.monotonic() - start, 2))
        rows.append(r)
        if args.verbose:
            print(f"{kind}: simulated in {r['simulated_s']:.1f} s", file=sys.stderr, flush=True)
    if not rows:
        raise PlanError("every system asked for was left out: " + "; ".join(
            w for w in info["warnings"] if " left out: " in w) + ". Ask for another system, "
            "or for a world size of 2 or more full nodes")
    rows.sort(key=lambda r: (not r["fits"], r["predicted_step_s"]))
    info["warnings"] += _measured_warnings(p, rows, args)
    return info, rows


def predict(model: str, systems, world_size: int, batch: int, seq: int,
            mixed_precision: bool = False, cluster: str = "dgx-h100",
            wrap: str | None = None, checkpoint: bool = False,
            attention: str | None = None) -> list[dict]:
    """The plan's rows for these systems, as ``benchmarks/compare_stages.py --model`` asks."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, "--world-size", str(world_size), "--batch",
                              str(batch), "--seq", str(seq), "--cluster", cluster])
    args.mixed_precision, args.systems = mixed_precision, list(systems)
    args.wrap_policy, args.activation_checkpointing = wrap, checkpoint or None
    args.attention_kernel = attention
    return plan(args)[1]


def table(info: dict, rows: list[dict], args) -> list[str]:
    p = _preset(args)
    how = ("simulated at 3 and 4 blocks and extended (they are alike)" if info["extend"] else
           "every block simulated")
    units = (f"{info['blocks']} blocks ({info['block_class']} in {info['block_list']}), one unit "
             f"each, and the root with the rest" if info["blocks"] else
             "no repeated blocks: one unit, the whole model")
    if getattr(args, "wrap_policy", None):
        units = (f"{info['units']} units by the wrap policy {args.wrap_policy} (the last the root "
                 f"with the rest; their collectives are not overlapped)")
    d, ac = p.device, args.activation_checkpointing
    scale = f", all scaled by --efficiency {args.efficiency:g}" if args.efficiency != 1 else ""
    cache = " Hugging Face config planned with use_cache off (training)." \
        if info["no_cache"] else ""
    precision = (", bf16 compute, fp32 master and reduction (DDP: fp32)" if args.mixed_precision
                 else ", fp32 (TF32 matmuls)")
    r0 = rows[0]
    run_flops = r0["flops_per_rank_per_step"] / (args.batch * args.seq)
    fwd, bwd = roofline.ATTENTION_KERNELS[d.attention_kernel]
    kernel = ("" if d.attention_kernel == "flash2" else
              f"; the run's {d.attention_kernel} kernel at {fwd:.2f} of its rate forward, "
              f"{bwd:.2f} backward")
    rates = d.matmul_rates
    where = (f"at the rates measured for their shapes (measured matmuls: {rates.source}), "
             f"a shape not measured " if rates is not None else "")
    out = [f"Model {args.model}: {info['params']:,} parameters; {units}; {how}.{cache}",
           f"Batch {args.batch} x seq {args.seq} per rank{precision}"
           f"{f', {ac} activation checkpointing' if ac else ''}; {args.world_size} ranks.",
           f"Cluster: {p.cluster.name}; {p.memory_bytes / 1e9:g} GB a GPU ({p.source}).",
           f"GPU time ({d.name}): matmuls {where}at {100 * d.matmul_efficiency:.1f}% of "
           f"{p.tflops(args.mixed_precision):g} TFLOPS (measured maximum) by their tiles' waves "
           f"on {d.sms} SMs, attention at {100 * d.attention_efficiency:.0f}% (FlashAttention-2, "
           f"measured{kernel}), the rest at {100 * d.memory_efficiency:.0f}% of "
           f"{d.memory_tbs:g} TB/s (measured), {d.launch_us:g} us a kernel at least"
           f"{f', clocks at {100 * d.clock_factor:.1f}% (power limit)' if d.clock_factor != 1 else ''}"
           f", {100 * d.comm_slowdown:.1f}% slower beside a collective{scale}; collectives "
           f"priced as NCCL picks them (zerolab/cost.py) and overlapped as each system "
           f"schedules them (zerolab/overlap.py).",
           f"FLOPs a token: {r0['model_flops_per_token'] / 1e9:.4g} G counted as MFU counts them "
           f"(3 x forward, attention whole), {run_flops / 1e9:.4g} G run (recompute in, causal "
           f"attention's masked half out).", "",
           "| system | fits | model states GB | peak GB (phase) | sent GB/step | comm s | "
           "exposed s | step s | tokens/s a GPU | MFU |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['system']} | {'yes' if r['fits'] else 'no'} | "
                   f"{r['model_state_bytes_per_rank'] / 1e9:.3f} | "
                   f"{r['peak_bytes_per_rank'] / 1e9:.3f} ({r['peak_phase']}) | "
                   f"{r['bytes_sent_per_rank_per_step'] / 1e9:.3f} | "
                   f"{r['comm_s']:.4f} | {r['exposed_comm_s']:.4f} | "
                   f"{r['predicted_step_s']:.4f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                   f"{100 * r['mfu']:.1f}% |")
    k = r0["compute_s_by_kind"]
    host = f" + host {k['host']:.4g}" if k["host"] else ""
    out += ["", f"Compute a step ({r0['system']}): {r0['compute_s']:.4g} s = matmuls "
                f"{k['matmul']:.4g} + attention {k['attention']:.4g} + memory-bound "
                f"{k['memory']:.4g}{host} s. "
                f"Peak GB: what is allocated (live tensors), not what the caching allocator "
                f"reserves (its cache and fragmentation come on top)."]
    if getattr(args, "explain", False):
        causes = [k for k in CAUSES if k in r0["step_s_by_cause"]]
        out += ["", "The step by cause (each effect added in turn to every operator at the rated "
                    "peak and bandwidth; zerolab/clusters.py names each source):", "",
                "| system | " + " | ".join(CAUSES[k] for k in causes) + " | step s |",
                "|---|" + "---|" * (len(causes) + 1)]
        for r in rows:
            c = r["step_s_by_cause"]
            out.append(f"| {r['system']} | " + " | ".join(
                f"{c[k]:.4f} ({100 * c[k] / r['predicted_step_s']:.1f}%)" for k in causes)
                + f" | {r['predicted_step_s']:.4f} |")
        if rates is not None:
            out += ["", f"measured matmuls: {len(rates.rates)} shapes at the rates measured "
                        f"for them, in place of the best-shape maximum by tiles and waves (the "
                        f"column: what that changes); source: {rates.source} "
                        f"(benchmarks/matmul_rates.py)."]
    for r in rows:
        if "host_bytes_per_rank" in r:
            out.append(f"\n{r['system']}: the host holds {r['host_bytes_per_rank'] / 1e9:.3f} GB "
                       f"a rank "
                       f"(the shards, their gradients, the optimizer state), and "
                       f"{r['host_device_bytes_per_step'] / 1e9:.3f} GB cross between host and "
                       f"device a step (in comm s); the columns are the device's.")
    out += [f"\nWarning: {w}" for w in info.get("warnings", [])]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a Hugging Face config.json (or its folder; needs transformers), "
                        "torchtitan:NAME:FLAVOR (torchtitan:llama3:8B; needs torchtitan), or "
                        "package.module:callable returning an nn.Module (required)")
    p.add_argument("--world-size", type=int, required=True,
                   help="ranks (GPUs) to plan for (required)")
    p.add_argument("--cluster", choices=sorted(PRESETS), default="dgx-h100",
                   help="the GPUs and links (zerolab/clusters.py names each figure's source) "
                        "(default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="override the preset's (default: the preset's)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="device memory a GPU, GB of 1e9 (default: the preset's)")
    p.add_argument("--tflops", type=float, default=None,
                   help="dense TFLOPS a GPU runs at, replacing the preset's rating and any power "
                        "limit it applies (default: the preset's)")
    p.add_argument("--intra-gbs", type=float, default=None,
                   help="the ring bus bandwidth NCCL reaches within a node, GB/s (default: the "
                        "preset's)")
    p.add_argument("--inter-gbs", type=float, default=None,
                   help="one NIC's line rate, GB/s each way (a node's channels spread over "
                        "its NICs) (default: the preset's)")
    p.add_argument("--attention-kernel", choices=sorted(roofline.ATTENTION_KERNELS), default=None,
                   help="the attention kernel the run uses: flash2 (FlashAttention-2, the "
                        "presets'), or triton (FlashAttention in Triton, MPT's attn_impl: "
                        "triton) (default: flash2)")
    p.add_argument("--efficiency", type=float, default=1.0,
                   help="multiply every achievable compute rate by this: your measured compute "
                        "time over the plan's (default: %(default)s, the preset's sources)")
    p.add_argument("--matmul-rates", default=None, metavar="FILE.json",
                   help="the matmul rates a GPU measured for this model's shapes "
                        "(benchmarks/matmul_rates.py), in place of the best-shape maximum by "
                        "tiles and waves; a shape not in the file keeps that model (default: "
                        "none)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="bf16 compute, fp32 master and reduction (default: fp32)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences per rank (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048,
                   help="tokens a sequence (default: %(default)s)")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   choices=("full", "selective"),
                   help="recompute each block in backward: full, or selective (torchtitan's "
                        "per-op policy: matmuls and attention kept, every second matmul "
                        "recomputed) (default: none; the flag alone: full)")
    p.add_argument("--wrap-policy", default=None, metavar="POLICY",
                   help="units by an FSDP1 auto-wrap policy, transformer:Class[,Class] or size:N "
                        "(runs every block), not the model's repeated blocks (default: the "
                        "repeated blocks)")
    p.add_argument("--explain", action="store_true",
                   help="each effect's share of the predicted step, per system (default: off)")
    p.add_argument("--exact", action="store_true",
                   help="simulate every block, not 3 and 4 blocks extended (default: extended "
                        "when the blocks are alike)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {SYSTEMS + FAMILY}, or 'all' (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="one object per system (default: none)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="model states and peak per system against the device's memory "
                        "(default: none)")
    p.add_argument("--verbose", action="store_true",
                   help="each system's simulation time (default: off)")


def run(args, parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand: a table on stdout; bad input exits 2 with one line."""
    args.systems = list(SYSTEMS + FAMILY) if args.systems == "all" else args.systems.split(",")
    bad = [s for s in args.systems if s not in SYSTEMS + FAMILY]
    if bad:
        parser.error(f"--systems: unknown {bad}; choose from {SYSTEMS + FAMILY}")
    for name, v in (("--world-size", args.world_size), ("--batch", args.batch),
                    ("--seq", args.seq),
                    ("--gpus-per-node", 1 if args.gpus_per_node is None else args.gpus_per_node)):
        if v < 1:
            parser.error(f"{name} must be >= 1, got {v}")
    for name, v in (("--efficiency", args.efficiency), ("--memory-gb", args.memory_gb),
                    ("--tflops", args.tflops), ("--intra-gbs", args.intra_gbs),
                    ("--inter-gbs", args.inter_gbs)):
        if v is not None and not 0 < v < float("inf"):
            parser.error(f"{name} must be a positive number, got {v}")
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
    ax.set_title(f"{args.model}, {args.world_size} ranks (step time: overlapped)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def step_ops(spec: str, batch: int, seq: int, mixed_precision: bool,
             checkpoint: str | None = None, world_size: int = 8) -> collections.Counter:
    """Every operator of one step of FSDP2 on ``world_size`` ranks, counted, from the plan's
    own simulation (``simulate``). The matmuls are every system's but DDP's (which
    computes in fp32); the memory-bound operators are FSDP2's."""
    info = check(spec, world_size, checkpoint, False, seq)
    depths = SAMPLE if info["extend"] else (None,)
    runs = [measured.count(simulate(spec, "fsdp2", world_size, batch, seq, mixed_precision,
                                    checkpoint, 8, blocks=d)) for d in depths]
    if len(runs) == 1:
        return runs[0]
    a, b = runs  # each block adds the same operators: the line through 3 and 4 blocks
    out: collections.Counter = collections.Counter()
    for key in {*a, *b}:
        n = b[key] + (b[key] - a[key]) * (info["blocks"] - SAMPLE[1])
        if n > 0:
            out[key] = n
    return out
