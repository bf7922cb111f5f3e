"""FSDP2's mixed-precision scenarios (test_fully_shard_mixed_precision.py), ported.

torch's reference keeps an fp32 master model for the optimizer and a copy in ``param_dtype``
for forward and backward; gradients are upcast, accumulated in fp32, averaged in
``reduce_dtype``, and the master weights are copied back into the compute copy after each
step (``MixedReference`` below). torch runs these on NCCL only; gloo on CPU reduces bf16 and
fp16 too, so here every stage is compared with that reference and with ``fully_shard``,
bitwise at world size 2.
"""

import contextlib
import copy
import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_distributed import SaveForwardInputsModel
from torch.testing._internal.common_fsdp import MLP
from torch.utils.checkpoint import checkpoint

import zero
from fsdp2_port import (ZERO, Trainer, data, fully_shard_units, mismatches, train,
                        zero_full, zero_fully_shard_units)
from conftest import sample
from harness import run_ranks

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class CastInputs(nn.Module):
    """The compute copy, fed inputs in ``dtype`` (what the sharded systems' casting does)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x):
        return self.module(x.to(self.dtype))


class MixedReference:
    """torch's mixed-precision reference, with the interface of ``fsdp2_port.Trainer``."""

    kind = "ref"

    def __init__(self, base: nn.Module, param_dtype, reduce_dtype):
        self.master = copy.deepcopy(base)
        self.compute = copy.deepcopy(base).to(param_dtype or FP32)
        self.model = CastInputs(self.compute, param_dtype or FP32)
        self.reduce_dtype = reduce_dtype or param_dtype or FP32
        self.opt = torch.optim.Adam(self.master.parameters(), lr=1e-2)

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        loss.backward()
        for p, c in zip(self.master.parameters(), self.compute.parameters()):
            grad, c.grad = c.grad.to(FP32), None  # accumulated in fp32
            p.grad = grad if p.grad is None else p.grad + grad
        if sync:
            self.reduce()

    def reduce(self) -> None:
        """Average over ranks in ``reduce_dtype``, dividing before and after the sum by FSDP2's
        factors, as torch's test does (fp16 divides early to avoid overflow)."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )

        group = dist.distributed_c10d._get_default_group()
        pre, post, _, _ = _get_gradient_divide_factors(group, None, self.reduce_dtype)
        for p in self.master.parameters():
            grad = p.grad.to(self.reduce_dtype).div_(pre or dist.get_world_size())
            dist.all_reduce(grad)
            if post and post > 1:
                grad.div_(post)
            p.grad = grad.to(FP32)

    def no_sync(self, modules=None):
        return contextlib.nullcontext()

    def step(self, it: int) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=it % 2 == 0)
        with torch.no_grad():
            for p, c in zip(self.master.parameters(), self.compute.parameters()):
                c.copy_(p)

    def full_params(self):
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}

    def full_grads(self):
        return {n: None if p.grad is None else p.grad.clone()
                for n, p in self.master.named_parameters()}


def systems(base, mp, raf=None, units=lambda m: [*m, m]):
    reference = MixedReference(base, *mp) if mp else Trainer("ref", base, units)
    return [reference] + [Trainer(k, base, units, mp=mp, raf=raf) for k in ("fsdp2", *ZERO)]


def mlps():
    torch.manual_seed(42)
    return nn.Sequential(*[MLP(16) for _ in range(3)])


def _training(rank, n, configs):
    out = []
    for mp, raf in configs:
        trainers = systems(mlps(), mp, raf)
        out += [f"{mp} raf={raf}: {line}" for line in
                train(trainers, 3, lambda m, it: m(data(rank, it, 4, 16)).sum())]
    return out


def test_compute_dtype_bf16():
    # Ports TestFullyShardMixedPrecisionTraining.test_compute_dtype: bf16 compute, reduced in
    # bf16, reshard_after_forward True and False.
    assert run_ranks(_training, 2, [((BF16, None), True), ((BF16, None), False)]) == [[], []]


def test_compute_dtype_fp16():
    # Ports test_compute_dtype with param_dtype fp16, reduced in fp16 with FSDP2's divide
    # factors (a bug this suite found, fixed in 13dab96: we summed first, then divided).
    assert run_ranks(_training, 2, [((FP16, None), False)]) == [[], []]


def _fp16_mean(rank, n):
    """{system: the mean of a gradient that is 40000 on each rank, reduced in fp16}."""
    out = {}
    for kind in ("fsdp2", *ZERO):
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        shard(kind, [(model, (FP16, None))])
        (model(torch.ones(1, 1)) * 40000.0).sum().backward()  # fits in fp16; twice does not
        grad = model.weight.grad
        out[kind] = (grad.full_tensor() if kind == "fsdp2" else
                     zero_full(model, "grads")["weight"]).item()
    return out


@functools.cache
def fp16_mean():
    return run_ranks(_fp16_mean, 2)[0]  # one run for the tests below


def test_fsdp2_fp16_reduction_does_not_overflow():
    # What torch's _get_gradient_divide_factors guards against (fp16 only): the mean of 40000
    # and 40000 is 40000, but their fp16 sum is inf.
    assert fp16_mean()["fsdp2"] == 40000.0


@pytest.mark.parametrize("kind", ZERO)
def test_fp16_reduction_does_not_overflow(kind):
    assert fp16_mean()[kind] == 40000.0


def test_reduce_dtype():
    # Ports test_reduce_dtype: bf16 compute with fp32 reduction, and fp32 compute with bf16
    # reduction (_test_reduce_dtype_fp32_reduce, _test_reduce_dtype_bf16_reduce).
    configs = [((BF16, FP32), True), ((BF16, FP32), False), ((None, BF16), True)]
    assert run_ranks(_training, 2, configs) == [[], []]


def _grad_acc_with_reduce_dtype(rank, n):
    out = []
    for raf in (True, False):
        trainers = systems(mlps(), (BF16, FP32), raf)
        for it in range(2):
            for t in trainers:
                for mb in range(4):
                    inp = data(rank, 10 * it + mb, 2, 16)
                    with t.no_sync() if mb < 3 else contextlib.nullcontext():
                        t.backward(t.model(inp).sum(), sync=mb == 3)
            out += mismatches(trainers, f"raf={raf} iteration {it}", grads=True)
            for t in trainers:
                t.step(it)
        out += mismatches(trainers, f"raf={raf}")
    return out


def test_grad_acc_with_reduce_dtype():
    # Ports test_grad_acc_with_reduce_dtype: with bf16 compute and fp32 reduction, gradients
    # accumulated under no_sync are accumulated in fp32 (issue 11 case 3, fixed in b7b0865).
    assert run_ranks(_grad_acc_with_reduce_dtype, 2) == [[], []]


# ---- test_structured_input_output: dataclasses and named tuples between units -----------------


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Pair
    z: torch.Tensor


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class ContainerLinear(nn.Module):
    """One linear layer applied to every tensor of a container; returns the same container."""

    def __init__(self, kind, dim=16):
        super().__init__()
        self.kind, self.layer = kind, nn.Linear(dim, dim)

    def forward(self, c):
        f = self.layer
        if self.kind == "dataclass":
            return Pair(f(c.x), f(c.y))
        if self.kind == "nested_dataclass":
            return Outer(Pair(f(c.inner.x), f(c.inner.y)), f(c.z))
        return TensorPair(f(c.x), f(c.y))


class ToContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "dataclass":
            return Pair(x, x.clone())
        if self.kind == "nested_dataclass":
            return Outer(Pair(x, x.clone()), x.clone())
        return TensorPair(x, x.clone())


class FromContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, c):
        return c.inner.x + c.inner.y + c.z if self.kind == "nested_dataclass" else c.x + c.y


def _structured(rank, n):
    """{container: mismatches}, each in fp32, bf16, and bf16 with fp32 reduction."""
    out = {}
    for kind in ("dataclass", "nested_dataclass", "namedtuple"):
        out[kind] = []
        for mp in (None, (BF16, BF16), (BF16, FP32)):
            torch.manual_seed(42)
            base = nn.Sequential(ToContainer(kind), ContainerLinear(kind), ContainerLinear(kind),
                                 FromContainer(kind))
            out[kind] += [f"{mp}: {line}" for line in
                          train(systems(base, mp), 2, lambda m, it: m(data(rank, it, 2, 16)).sum())]
    return out


@functools.cache
def structured():
    return run_ranks(_structured, 2)  # one run for the three tests below


@pytest.mark.parametrize("kind", sample(["nested_dataclass"], ["dataclass", "nested_dataclass", "namedtuple"]))
def test_structured_input_output(kind):
    # Ports test_structured_input_output (fp32, bf16, bf16 with fp32 reduction). Dataclasses
    # between units were issue 11 case 4, fixed in b7b0865.
    assert [ranks[kind] for ranks in structured()] == [[], []]


# ---- TestFullyShardMixedPrecisionCasts and friends: which dtype reaches which module ----------


class RecordingLinear(nn.Linear):
    def __init__(self):
        super().__init__(1, 1)
        self.input_dtypes = []

    def forward(self, x):
        self.input_dtypes.append(x.dtype)
        return super().forward(x)


class CheckpointedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = RecordingLinear()

    def forward(self, x):
        return checkpoint(self.linear1, x, use_reentrant=False).float().sum()


class ExternalInputs(nn.Module):
    """torch's ToyModule: records the dtypes of both its inputs."""

    def __init__(self, seen):
        super().__init__()
        self.l, self.seen = nn.Linear(8, 8), seen

    def forward(self, x, y):
        self.seen["l2"] = [x.dtype, y.dtype]
        return self.l(x)


class ExternalInputModel(nn.Module):
    """torch's ToyModel: the second unit also gets an fp32 tensor made in the root's forward."""

    def __init__(self, seen):
        super().__init__()
        self.l1, self.l2, self.seen = nn.Linear(8, 8), ExternalInputs(seen), seen

    def forward(self, x):
        self.seen["model"] = x.dtype
        return self.l2(self.l1(x), torch.ones(2, 8))


def shard(kind, units):
    """``kind`` ("fsdp2" or "zeroN") on ``units``: (module, (param_dtype, reduce_dtype) or None)."""
    for unit, mp in units:
        if kind == "fsdp2":
            fully_shard_units([unit], mp=mp)
        elif kind == "zero.fully_shard":
            zero_fully_shard_units([unit], mp=mp)
        else:
            policy = zero.MixedPrecision(*mp) if mp else None
            zero.shard(unit, stage=int(kind[-1]), mp_policy=policy)


def _casts(rank, n):
    got = {}
    for kind in ("fsdp2", *ZERO):
        got[kind] = seen = {}
        # test_float16_on_one_submodule (subtest 1): fp16 on the second child only
        torch.manual_seed(42)
        inputs = {}
        model = SaveForwardInputsModel(inputs, cast_forward_inputs=False)
        shard(kind, [(model.c2, (FP16, None)), (model, None)])
        model(torch.zeros(2, 100)).sum().backward()
        seen["one submodule"] = [inputs[m].dtype for m in (model, model.c1, model.c2)]
        # test_submodules_with_external_inputs (enable_submodule_cast=True)
        model = ExternalInputModel(seen)
        shard(kind, [(model.l2, (FP16, None)), (model, (FP16, None))])
        model(torch.zeros(2, 8)).sum().backward()
        # test_checkpoint_recompute_casts_forward_inputs: the recomputation is cast as well
        model = CheckpointedLinear()
        shard(kind, [(model.linear1, (BF16, BF16)), (model, (BF16, BF16))])
        model(torch.randn(8, 1)).backward()
        seen["recompute"] = model.linear1.input_dtypes
        # test_norm_modules: LayerNorm; BatchNorm2d with its running statistics cast down
        for name, make, shape in (
                ("layer norm", lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8),
                                                     nn.Linear(8, 8)), (4, 8)),
                ("batch norm", lambda: nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5),
                                                     nn.Conv2d(5, 4, 3)), (3, 1, 9, 9))):
            model = make()
            if name == "batch norm":
                model[1].running_mean = model[1].running_mean.to(BF16)
                model[1].running_var = model[1].running_var.to(BF16)
            shard(kind, [(m, (BF16, None)) for m in (*model, model)])
            z = model(torch.randn(*shape))
            z.sum().backward()
            seen[name] = z.dtype
    return got


def test_casts_like_fsdp2():
    # Ports TestFullyShardMixedPrecisionCasts.test_float16_on_one_submodule (subtest 1),
    # test_submodules_with_external_inputs (cast enabled), test_checkpoint_recompute_casts_
    # forward_inputs and test_norm_modules (LayerNorm; BatchNorm2d with bf16 statistics):
    # every module sees the dtypes it sees under fully_shard, at every stage.
    got = run_ranks(_casts, 2)[0]
    assert got["fsdp2"]["one submodule"] == [FP32, FP32, FP16]
    assert got["fsdp2"]["l2"] == [FP16, FP16] and got["fsdp2"]["recompute"] == [BF16, BF16]
    for kind in ZERO:
        assert got[kind] == got["fsdp2"], kind


def _reduce_dtype_after_frozen_forward(rank, n):
    out = []
    for stage in (1, 2, 3):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        zero.shard(model, stage=stage, mp_policy=zero.MixedPrecision(BF16, FP32))
        model.requires_grad_(False)
        with torch.no_grad():
            model(torch.randn(4, 16))
        model.requires_grad_(True)
        with zero.Ledger() as ledger:
            model(torch.randn(4, 16)).sum().backward()
        out.append(([r.dtype for r in ledger.select(op="reduce_scatter")],
                    [p.grad.dtype for p in model.parameters()]))
    return out


def test_reduce_dtype_after_frozen_first_forward():
    # Ports test_reduce_dtype_after_frozen_first_forward, without its int64 parameter (one
    # unit holds one dtype: notes/11-conformance.md): frozen for a no_grad forward, unfrozen,
    # then reduced in fp32 with fp32 gradients, at every stage.
    assert run_ranks(_reduce_dtype_after_frozen_forward, 2)[0] == [([FP32], [FP32] * 4)] * 3
