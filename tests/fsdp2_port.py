"""What the FSDP2 conformance tests (tests/test_fsdp2_*.py) share.

Each of those tests ports a scenario of PyTorch's own FSDP2 tests
(``test/distributed/_composable/fsdp/test_fully_shard_*.py`` in the PyTorch repository) and
runs it, in the same ranks and on the same data, with several systems built from one model:

- "replicate": torch's ``replicate`` (composable DDP), the reference of torch's training tests;
- "ref": a plain replica whose gradients are averaged over the ranks with ``all_reduce`` after
  backward, the reference torch's tests build by hand (a model on the global batch, divided by
  the world size, is the same reference; per rank it can be compared bitwise);
- "fsdp2": ``fully_shard`` on the same units;
- "zero1", "zero2", "zero3": ``zero.shard`` on the same units;
- "zero.fully_shard": ``zero.fully_shard`` on the same units, with FSDP2's arguments (stage 3,
  FSDP2's rows layout): the drop-in, run through every scenario as FSDP2 is.

At world size 2 in fp32 all of them must agree bitwise (notes/07-equality.md says why that is
possible). ``mismatches`` lists what does not, one line per disagreement, each starting with the
system that disagrees, so a test can assert per system.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import FULL

import zero
from zero.core.rows import local_tensor
from zerolab.systems import average_gradients as average_grads  # DDP by hand

# Our entry points: zero.shard at each stage, and zero.fully_shard (FSDP2's call, stage 3),
# which the suite samples (tests/surface/test_fully_shard.py tests it directly); ZERO_FULL=1 runs both.
ZERO = ("zero1", "zero2", "zero3") + (("zero.fully_shard",) if FULL else ())
ALL = ("ref", "fsdp2", *ZERO)


def fully_shard_units(units: Iterable[nn.Module], *, mp=None, raf=None) -> None:
    """FSDP2 on ``units`` (bottom-up, the root last); ``mp`` is (param_dtype, reduce_dtype)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(*mp) if mp else MixedPrecisionPolicy()
    kw = {} if raf is None else {"reshard_after_forward": raf}
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, **kw)


def zero_fully_shard_units(units: Iterable[nn.Module], *, mp=None, raf=None) -> None:
    """``zero.fully_shard`` on ``units``, called exactly as ``fully_shard_units`` calls FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(*mp) if mp else MixedPrecisionPolicy()
    kw = {} if raf is None else {"reshard_after_forward": raf}
    for unit in units:
        zero.fully_shard(unit, mesh=mesh, mp_policy=policy, **kw)


def zero_shard_units(units: Iterable[nn.Module], stage: int, *, mp=None, raf=None) -> None:
    """``zero.shard`` on ``units`` (bottom-up, the root last), as ``fully_shard_units`` does."""
    policy = zero.MixedPrecision(*mp) if mp else None
    for unit in units:
        zero.shard(unit, stage=stage, mp_policy=policy,
                   reshard_after_forward=raf if stage == 3 else None)


class Trainer:
    """One copy of ``base`` trained by the system ``kind`` (see the module docstring).

    Args:
        units: ``units(model)`` lists the modules to shard, bottom-up, the root last.
        mp: (param_dtype, reduce_dtype) for "fsdp2" and ours; None for full precision.
        raf: ``reshard_after_forward`` for "fsdp2" and stage 3 (None: each one's default).
        prepare: applied to every copy, the references' too, before sharding (activation
            checkpointing, say).
        replicate_kw: keyword arguments for torch's ``replicate``.
    """

    def __init__(self, kind: str, base: nn.Module, units: Callable, *, mp=None, raf=None,
                 prepare: Callable | None = None, replicate_kw: dict | None = None):
        self.kind = kind
        self.model = copy.deepcopy(base)
        if prepare is not None:
            prepare(self.model)
        if kind == "fsdp2":
            fully_shard_units(units(self.model), mp=mp, raf=raf)
        elif kind == "zero.fully_shard":
            zero_fully_shard_units(units(self.model), mp=mp, raf=raf)
        elif kind in ZERO:
            zero_shard_units(units(self.model), int(kind[-1]), mp=mp, raf=raf)
        elif kind == "replicate":
            from torch.distributed._composable import replicate

            replicate(self.model, **(replicate_kw or {}))
        elif kind != "ref":
            raise ValueError(f"unknown system {kind!r}")
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)  # as torch's tests

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """``loss.backward()``; then "ref" averages its gradients over the ranks (if ``sync``)."""
        loss.backward()
        if self.kind == "ref" and sync:
            average_grads(self.model)

    def step(self, it: int) -> None:
        """The optimizer step; ``zero_grad`` alternates set_to_none, as torch's tests do."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=it % 2 == 0)

    @contextlib.contextmanager
    def no_sync(self, modules=None):
        """Accumulate without reducing, on ``modules`` (default: the whole model); "ref"
        accumulates locally until a ``backward`` with ``sync`` (or ``average_grads``)."""
        modules = [self.model] if modules is None else list(modules)
        if self.kind == "fsdp2":
            for m in modules:
                m.set_requires_gradient_sync(False, recurse=True)
            try:
                yield
            finally:
                for m in modules:
                    m.set_requires_gradient_sync(True, recurse=True)
        elif self.kind in ZERO:
            with contextlib.ExitStack() as stack:
                for m in modules:
                    stack.enter_context(zero.no_sync(m))
                yield
        else:
            yield

    def full_params(self) -> dict[str, torch.Tensor]:
        """{name: whole parameter} (collective for the sharded systems)."""
        if self.kind == "fsdp2":
            reshard_fsdp2(self.model)  # a root that kept its parameters exposes them unsharded
            return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        if self.kind in ZERO:
            return zero_full(self.model, "params")
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """{name: whole gradient or None} (collective for the sharded systems)."""
        named = list(self.model.named_parameters())
        if self.kind == "fsdp2":
            return {n: None if p.grad is None else p.grad.full_tensor().clone() for n, p in named}
        if self.kind in ZERO:
            return zero_full(self.model, "grads")
        return {n: None if p.grad is None else p.grad.clone() for n, p in named}


def reshard_fsdp2(model: nn.Module) -> None:
    """Reshard every FSDP2 module (after a forward that kept its parameters unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def zero_full(model: nn.Module, what: str) -> dict[str, torch.Tensor | None]:
    """Our parameters or gradients (``what``), whole, by ``named_parameters`` name: each unit's
    shards (or gradient pieces, None where no rank has one) all-gathered into its flat layout.
    (``zero.full_state_dict`` has its own tests; this reads the same names as the others.)"""
    named = list(model.named_parameters())
    has = torch.tensor([what == "params" or p.grad is not None for _, p in named],
                       dtype=torch.uint8)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    whole = {}
    for unit in zero.units_of(model):
        local = unit.sharded.detach().clone()
        if what == "grads":
            local.zero_()
            for i, p in enumerate(unit.params):
                if p.grad is not None:
                    unit.piece(local, i).copy_(local_tensor(p.grad).reshape(-1))
        flat = local.new_empty(unit.layout.padded_numel)
        dist.all_gather_into_tensor(flat, local)
        whole[unit] = unit.layout.views(unit.layout.from_wire(flat))
    index = {p: (u, i) for u in whole for i, p in enumerate(u.params)}
    return {n: whole[index[p][0]][index[p][1]].clone() if h else None
            for (n, p), h in zip(named, has.tolist())}


def difference(a: dict, b: dict, exact: bool = True) -> str | None:
    """None if ``a`` and ``b`` have the same names and equal tensors (bitwise, or within torch's
    default fp32 tolerance when not ``exact``); else what differs first."""
    if a.keys() != b.keys():
        return f"names differ: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        x, y = a[name], b[name]
        if x is None or y is None:
            if x is not y:
                return f"{name}: gradient {'None' if x is None else 'set'} vs " \
                       f"{'None' if y is None else 'set'}"
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {tuple(x.shape)}/{x.dtype} vs {tuple(y.shape)}/{y.dtype}"
        same = torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1.3e-6, atol=1e-5)
        if not same:
            return f"{name}: max |diff| {(x - y).abs().max().item():.3g}"
    return None


def mismatches(trainers: list, where: str, grads: bool = False, exact: bool = True) -> list[str]:
    """Compare every system with the first (the reference), and ours with "fsdp2" as well.

    Returns lines "<system> vs <other> <params|grads> <where>: <what differs>".
    """
    read = (lambda t: t.full_grads()) if grads else (lambda t: t.full_params())
    full = {t.kind: read(t) for t in trainers}  # every rank reads in the same order
    ref, what = trainers[0].kind, "grads" if grads else "params"
    out = []
    for kind, values in full.items():
        others = [ref] + (["fsdp2"] if kind in ZERO and "fsdp2" in full else [])
        for other in others:
            if other != kind and (diff := difference(values, full[other], exact)):
                out.append(f"{kind} vs {other} {what} {where}: {diff}")
    return out


def loss_mismatches(trainers: list, losses: list[torch.Tensor], where: str) -> list[str]:
    """Lines "<system> loss <where>: ..." for each loss not bitwise equal to the first one's."""
    return [f"{t.kind} loss {where}: {loss.item()!r} vs {losses[0].item()!r}"
            for t, loss in zip(trainers, losses) if not torch.equal(loss, losses[0])]


def train(trainers: list, iters: int, loss_of: Callable, every: bool = False) -> list[str]:
    """Run ``iters`` iterations (forward, backward, step) on every system and compare them.

    ``loss_of(model, it)`` runs the forward and returns the loss. Losses are compared every
    iteration; gradients (before the step) and parameters (after it) at the last iteration, or
    at every iteration with ``every`` (reading whole tensors back is most of a test's time).
    """
    bad = []
    for it in range(iters):
        losses = []
        for t in trainers:
            loss = loss_of(t.model, it)
            t.backward(loss)
            losses.append(loss.detach())
        bad += loss_mismatches(trainers, losses, f"iteration {it}")
        check = every or it == iters - 1
        if check:
            bad += mismatches(trainers, f"iteration {it}", grads=True)
        for t in trainers:
            t.step(it)
        if check:
            bad += mismatches(trainers, f"iteration {it}")
    return bad


@contextlib.contextmanager
def fsdp2_collectives():
    """Count FSDP2's all-gathers and reduce-scatters, as torch's tests do (patching
    ``torch.distributed``; ours bound their functions at import and are not counted)."""
    from torch.testing._internal.common_fsdp import patch_all_gather, patch_reduce_scatter

    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with patch_all_gather(counting("all_gather", dist.all_gather_single)), \
            patch_reduce_scatter(counting("reduce_scatter", dist.reduce_scatter_single)):
        yield counts


def of(kind: str, lines: list[str]) -> list[str]:
    """The lines of ``mismatches``/``loss_mismatches`` about system ``kind``."""
    return [line for line in lines if line.startswith(kind + " ")]


def data(rank: int, it: int, *shape: int, vocab: int | None = None) -> torch.Tensor:
    """This rank's input for iteration ``it``: the same for every system, different per rank."""
    gen = torch.Generator().manual_seed(1000 * it + rank)
    if vocab is not None:
        return torch.randint(0, vocab, shape, generator=gen)
    return torch.randn(*shape, generator=gen)
