"""The systems we compare, each built the same way from the same model (tests, benchmarks).

- "ddp": ``DistributedDataParallel``; "ddp+zro": DDP with torch's ``ZeroRedundancyOptimizer``
  (torch's ZeRO-1: whole parameters per rank, gradients still all-reduced);
- "zero1", "zero2", "zero3": ours, ``zero.shard`` on the model's ``units()``;
- "fsdp2", "fsdp2-noreshard": torch's ``fully_shard`` on the same units, with
  ``reshard_after_forward`` True (ZeRO-3) or False (ZeRO-2-like);
- "replicated": plain PyTorch on every rank, each gradient all-reduced to its mean after
  the last backward of a step. It computes what DDP computes (bitwise at world size 2:
  halving is exact) for model code that DDP refuses (reentrant checkpointing with
  rank-dependent unused parameters, parameters unfrozen after wrapping).

A model here is one of ``zerolab.models``: it has ``units()``, ``batch()`` and ``loss()``.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import zero

KINDS = ("ddp", "ddp+zro", "zero1", "zero2", "zero3", "fsdp2-noreshard", "fsdp2")
# The rest of the ZeRO family, selectable by name (not in the default comparison): ZeRO-3 with
# its shards on the host (ZeRO-Offload), its optimizer state in files too (ZeRO-Infinity's
# disk tier), with int8 weight all-gathers (ZeRO++'s qwZ), and with 4-bit gradient
# reductions by two all-to-alls over nodes of two ranks (ZeRO++'s qgZ; 4 ranks or more).
FAMILY = ("zero3-offload", "zero3-disk", "zero3-qwz", "zero3-qgz")


def gpt_35m() -> nn.Module:
    """The larger model of the emulated targets (benchmarks/compare_stages.py --targets): the
    comparison's GPT at 20 blocks of 384, 35.7M parameters (vocabulary 512, 4 heads)."""
    from zerolab.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=512, seq=64, dim=384, layers=20, heads=4))


def stage_of(kind: str) -> int:
    """Our stage in a system's name: "zero2" -> 2, "zero3-offload" -> 3."""
    return int(kind[4])


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
        raise ValueError(f"unknown optimizer {kind!r}")
    if zro:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kw)
    return cls(groups, **kw)


class System:
    """One training setup: a copy of ``base``, its optimizer, and how to read it back.

    Args:
        kind: one of ``KINDS`` or ``FAMILY``.
        base: the model to copy (it is not modified).
        opt: "adamw", "sgd" or "adamw_groups".
        mp: bf16 parameters with fp32 reduction (ours and FSDP2 only).
        reshard_after_forward: for the non-root units of "zero3" and "fsdp2".
        mesh_shape: (replicas, shards): HSDP for ours and FSDP2 (default: one flat group).
        ranks_per_node: ours at stage 3: hpZ, a secondary shard over groups of this many ranks.
        layout: ours: which rank holds which element ("flat", "rows", "whole").
        wrap: ours: which modules become units (``WRAPS``): "units" (the model's ``units()``,
            one per block), "pairs" (one per two blocks), "size-<n>" (FSDP1's size-based
            policy, ``min_num_params=n``), "root" (one unit for the whole model).
    """

    def __init__(self, kind: str, base: nn.Module, opt: str = "adamw", mp: bool = False,
                 reshard_after_forward: bool | None = None, mesh_shape: tuple | None = None,
                 ranks_per_node: int | None = None, layout: str = "flat", wrap: str = "units",
                 shard: dict | None = None):
        self.kind, self.base = kind, base
        # ours: a stage of KINDS or FAMILY, or a variant: ``shard`` holds the zero.shard
        # arguments (any, policies included) of a schedule of someone's own ("stage": 3 if
        # not given), applied to every unit as "zero3"'s are (zerolab.variants)
        self.ours = kind.startswith("zero") or shard is not None
        model = copy.deepcopy(base)
        if shard is not None:
            shard = dict(shard)
            stage = shard.pop("stage", 3)
            policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
            fp32_units = getattr(model, "fp32_units", list)()
            for unit in model.units():
                unit_policy = None if any(unit is m for m in fp32_units) else policy
                zero.shard(unit, **{"stage": stage, "mp_policy": unit_policy, **shard})
            self.model = model
            self.opt = make_optimizer(opt, list(model.named_parameters()))
            return
        if kind == "replicated":
            self.model = model
            self.opt = make_optimizer(opt, list(model.named_parameters()))
            return
        if kind in ("ddp", "ddp+zro"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            # DDP must be told about parameters that get no gradient (UnevenMLP.unused...)
            unused = getattr(base, "has_unused_parameters", False)
            self.model = DDP(model, find_unused_parameters=unused)
            named = [(n.removeprefix("module."), p) for n, p in self.model.named_parameters()]
            self.opt = make_optimizer(opt, named, zro=kind == "ddp+zro")
            return
        # Units the model wants computed in fp32 whatever the policy (a router that casts itself)
        fp32_units = getattr(model, "fp32_units", list)()
        if kind.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            device = next(model.parameters()).device.type
            mesh = init_device_mesh(device, mesh_shape or (dist.get_world_size(),),
                                    mesh_dim_names=("replicate", "shard") if mesh_shape else None)
            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp else MixedPrecisionPolicy()
            if kind == "fsdp2-noreshard":
                reshard_after_forward = False
            for unit in model.units():
                kw = {} if (reshard_after_forward is None or unit is model) else {
                    "reshard_after_forward": reshard_after_forward}
                fp32 = any(unit is m for m in fp32_units)
                unit_policy = MixedPrecisionPolicy() if fp32 else policy
                fully_shard(unit, mesh=mesh, mp_policy=unit_policy, **kw)
        else:
            policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
            device = next(model.parameters()).device.type
            hybrid = {}
            if mesh_shape:
                from torch.distributed.device_mesh import init_device_mesh

                hybrid["mesh"] = init_device_mesh(device, mesh_shape,
                                                  mesh_dim_names=("replicate", "shard"))
            if ranks_per_node:
                from torch.distributed.device_mesh import init_device_mesh

                nodes = dist.get_world_size() // ranks_per_node
                node_mesh = init_device_mesh(device, (nodes, ranks_per_node))
                hybrid["secondary_group"] = node_mesh.get_group(1)
            if kind == "zero3-offload":
                hybrid["offload_policy"] = zero.CPUOffload()
            if kind == "zero3-disk":  # (the store makes, and removes, its own directory)
                hybrid["offload_policy"] = zero.DiskOffload(tempfile.gettempdir())
            if kind == "zero3-qgz":
                from torch.distributed.device_mesh import init_device_mesh

                n = dist.get_world_size()
                if n < 4 or n % 2:
                    raise ValueError(f"zero3-qgz plays nodes of 2 ranks and needs 2 nodes or "
                                     f"more: an even world size of 4 or more, not {n}")
                hybrid["comm_policy"] = zero.QuantizedGradients(
                    init_device_mesh(device, (n // 2, 2)))
            if kind == "zero3-qwz":
                hybrid["comm_policy"] = zero.QuantizedWeights()
            if wrap != "units":
                wrap_units(model, wrap, stage=stage_of(kind), mp_policy=policy, layout=layout)
            for unit in model.units() if wrap == "units" else []:
                rafa = reshard_after_forward if unit is not model else None
                unit_policy = None if any(unit is m for m in fp32_units) else policy
                zero.shard(unit, stage=stage_of(kind), mp_policy=unit_policy,
                           reshard_after_forward=rafa, layout=layout, **hybrid)
        self.model = model
        self.opt = make_optimizer(opt, list(model.named_parameters()))

    def no_sync(self):
        if self.ours:
            return zero.no_sync(self.model)
        if self.kind == "replicated":
            return contextlib.nullcontext()  # it averages only after the step's last backward
        if self.kind.startswith("ddp"):
            return self.model.no_sync()
        if self.kind.startswith("fsdp2"):
            return _fsdp2_no_sync(self.model)
        return zero.no_sync(self.model)

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if self.ours:
            return zero.clip_grad_norm_(self.model, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_params(self) -> dict[str, torch.Tensor]:
        if self.kind.startswith("ddp") and not self.ours:
            return {n: p.detach().clone() for n, p in self.model.module.named_parameters()}
        if self.kind == "replicated":
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}
        if self.kind.startswith("fsdp2") and not self.ours:
            return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        if self.ours and hasattr(next(self.model.parameters()), "full_tensor"):
            pass  # rows: DTensor parameters, but gathered like every layout, below
        full = zero.full_state_dict(self.model)  # also buffers and tied aliases: keep params
        return {n: full[n].clone() for n, _ in self.model.named_parameters()}

    def step(self, rank: int, step: int, micro: int = 1, clip: tuple | None = None,
             batch: int = 4):
        """One optimizer step over ``micro`` micro-batches; returns the losses and clip norm.

        The data depends only on (rank, step, micro-batch), so every system sees the same.
        """
        losses = []
        device = next(iter(self.model.parameters())).device
        for m in range(micro):
            gen = torch.Generator().manual_seed(1000 * step + 10 * rank + m)
            x, y = (t.to(device) for t in self.base.batch(batch, gen))
            with self.no_sync() if m < micro - 1 else contextlib.nullcontext():
                loss = self.base.loss(self.model(x), y)
                loss.backward()
            losses.append(loss.detach().float())
        if self.kind == "replicated":
            average_gradients(self.model)
        norm = self.clip(*clip) if clip else None
        self.opt.step()
        self.opt.zero_grad()
        return torch.stack(losses), norm


WRAPS = ("units", "pairs", "size-20000", "size-100000", "root")


def wrap_units(model: nn.Module, wrap: str, **kwargs) -> None:
    """Units of another size than the model's own (benchmarks/wrap.py): two blocks a unit, FSDP1's
    size-based policy at a threshold, or the whole model as one unit."""
    if wrap == "pairs":
        blocks = list(model.blocks)
        for i in range(0, len(blocks), 2):
            zero.shard(blocks[i : i + 2], **kwargs)
        zero.shard(model, **kwargs)
    elif wrap.startswith("size-"):
        import functools

        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=int(wrap[5:]))
        zero.shard(model, auto_wrap_policy=policy, **kwargs)
    elif wrap == "root":
        zero.shard(model, **kwargs)
    else:
        raise ValueError(f"unknown wrap {wrap!r}: one of {WRAPS}")


def average_gradients(model: nn.Module) -> None:
    """Each gradient's mean over ranks, in place, as DDP computes it (a parameter with no
    gradient on some rank counts zero there; one with none on any rank keeps None)."""
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    for p, any_rank in zip(params, got.tolist()):
        if any_rank:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


class _fsdp2_no_sync(contextlib.AbstractContextManager):
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
