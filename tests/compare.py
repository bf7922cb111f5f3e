"""Train the same model with several systems in one rank and compare them step by step.

Systems: "ddp", "ddp+zro" (DDP with torch's ZeroRedundancyOptimizer), "zero1", "zero2",
"zero3" (ours) and "fsdp2" (torch's fully_shard on the same units). Every system starts
from the same initial weights and sees the same per-rank data, so at world size 2 their
parameters must agree bitwise after every step (the numerical contract, shared/DESIGN.md).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from zero.models import GPT, EncoderStack, UnevenMLP

MODELS = {"gpt": GPT, "mlp": UnevenMLP, "encoder": EncoderStack}


def _no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln" in name or name.startswith("ln") or "norm" in name


def make_optimizer(kind: str, named: list[tuple[str, nn.Parameter]], zro: bool = False):
    """AdamW, SGD with momentum, or AdamW with per-parameter option groups (chosen by name)."""
    params = [p for _, p in named]
    if kind == "sgd":
        cls, kw, groups = torch.optim.SGD, dict(lr=0.05, momentum=0.9), params
    elif kind == "adamw":
        cls, kw, groups = torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params
    elif kind == "adamw_groups":  # no weight decay on biases and norms; a lower lr for them
        cls, kw = torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)
        groups = [
            {"params": [p for n, p in named if not _no_decay(n)]},
            {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0, "lr": 3e-3},
        ]
    else:
        raise ValueError(kind)
    if zro:
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kw)
    return cls(groups, **kw)


class System:
    """One training setup: a model copy, its optimizer, and how to read its full parameters."""

    def __init__(self, kind: str, base: nn.Module, opt: str, mp: bool = False,
                 reshard_after_forward: bool | None = None):
        self.kind = kind
        model = copy.deepcopy(base)
        if kind in ("ddp", "ddp+zro"):
            # DDP must be told about parameters that get no gradient (UnevenMLP.unused...)
            unused = getattr(base, "has_unused_parameters", False)
            self.model = DDP(model, find_unused_parameters=unused)
            named = [(n.removeprefix("module."), p) for n, p in self.model.named_parameters()]
            self.opt = make_optimizer(opt, named, zro=kind == "ddp+zro")
        elif kind == "fsdp2":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp else MixedPrecisionPolicy()
            for unit in model.units():
                rafa = reshard_after_forward if unit is not model else None
                if rafa is None:
                    fully_shard(unit, mesh=mesh, mp_policy=policy)
                else:
                    fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=rafa)
            self.model = model
            self.opt = make_optimizer(opt, list(model.named_parameters()))
        else:
            stage = int(kind[-1])
            policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
            for unit in model.units():
                rafa = reshard_after_forward if unit is not model else None
                zero.shard(unit, stage=stage, mp_policy=policy, reshard_after_forward=rafa)
            self.model = model
            self.opt = make_optimizer(opt, list(model.named_parameters()))
        self.base = base

    def no_sync(self):
        if self.kind.startswith("ddp"):
            return self.model.no_sync()
        if self.kind == "fsdp2":
            return _fsdp2_no_sync(self.model)
        return zero.no_sync(self.model)

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if self.kind.startswith("zero"):
            return zero.clip_grad_norm_(self.model, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.kind.startswith("ddp"):
            return {n: p.detach().clone() for n, p in self.model.module.named_parameters()}
        if self.kind == "fsdp2":
            return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        return {n: t.clone() for n, t in zero.full_state_dict(self.model).items()}

    def step(self, rank: int, step: int, micro: int = 1, clip: tuple | None = None):
        """One optimizer step over ``micro`` micro-batches; returns the loss and clip norm."""
        losses = []
        for m in range(micro):
            gen = torch.Generator().manual_seed(1000 * step + 10 * rank + m)
            x, y = self.base.batch(4, gen)
            ctx = self.no_sync() if m < micro - 1 else _nullcontext()
            with ctx:
                loss = self.base.loss(self.model(x), y)
                loss.backward()
            losses.append(loss.detach().float())
        norm = self.clip(*clip) if clip else None
        self.opt.step()
        self.opt.zero_grad()
        return torch.stack(losses), norm


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _fsdp2_no_sync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *a):
        self.model.set_requires_gradient_sync(True)


def first_difference(a: dict, b: dict) -> str | None:
    """None if ``a`` and ``b`` hold the same names and bitwise equal tensors, else what differs."""
    if a.keys() != b.keys():
        return f"names differ: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        if a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            return f"{name}: {a[name].shape}/{a[name].dtype} vs {b[name].shape}/{b[name].dtype}"
        if not torch.equal(a[name], b[name]):
            return f"{name}: max |diff| {(a[name] - b[name]).abs().max().item():.3g}"
    return None


def max_relative_difference(a: dict, b: dict) -> float:
    """max over parameters of max|a - b| / max|b| (a norm-wise relative error)."""
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in a)


def optimizer_state_difference(ours: System, ref: System, keys=("exp_avg", "exp_avg_sq")):
    """Compare our local pieces' optimizer state with the matching slice of the reference's."""
    ref_params = dict(ref.model.module.named_parameters())
    for name, p in ours.model.named_parameters():
        if p not in ours.opt.state:
            continue
        r = ref.opt.state[ref_params[name]]
        piece = p._zero_unit._pieces.get(p._zero_index)
        lo, n = (piece.param_offset, piece.length) if piece else (0, 0)
        for key in keys:
            if key in r and not torch.equal(ours.opt.state[p][key], r[key].reshape(-1)[lo : lo + n]):
                return f"{name}.{key}"
    return None


def run_and_compare(rank: int, systems: list[System], steps: int, check: Callable, **step_kw):
    """Step every system ``steps`` times; after each step call ``check(step, systems, outs)``."""
    for s in range(steps):
        outs = [sys_.step(rank, s, **step_kw) for sys_ in systems]
        check(s, systems, outs)
