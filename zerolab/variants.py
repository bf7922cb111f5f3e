"""Variants: a schedule of your own beside the built-in systems, and whether it computes what they
compute.

A *variant* is a set of ``zero.shard`` arguments (any of them, policies included: a
``schedule=``, a ``comm_policy=``, ``reshard_after_forward=``, ``reduce_scatter_depth=``...),
applied to every unit of the model as the built-in "zero3" is (``zerolab.systems.System(...,
shard=...)``; ``"stage"`` defaults to 3). It is named on the command line as
``NAME=module:factory``, the factory a function of no arguments that returns the dict::

    # mine.py
    def prefetch_two():
        return {"stage": 3, "prefetch": 2}

    python benchmarks/compare_stages.py --variant deep=mine:prefetch_two --network dgx-h100

``equal_to`` trains a candidate (a built-in kind, a variant's dict, or its ``module:factory``)
beside a reference (DDP, FSDP2, a stage) on local ranks and says whether their parameters are
bitwise equal after every step, or within a relative ``tolerance``: what a test or a script
asks of a variant before timing it::

    from zerolab.variants import equal_to
    assert equal_to({"stage": 3, "prefetch": 2}, "fsdp2")  # a Verdict: truthy when equal
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn


def prefetch_two() -> dict:
    """An example variant: ZeRO-3 gathering two units ahead instead of one
    (``--variant deep=zerolab.variants:prefetch_two``)."""
    return {"stage": 3, "prefetch": 2}


def load(spec: str | dict) -> dict:
    """A variant's ``zero.shard`` arguments: ``spec`` itself (a dict), or what the factory that
    ``module:factory`` names returns."""
    if isinstance(spec, dict):
        return dict(spec)
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"variant {spec!r}: write module:factory (the module importable, the "
                         f"factory returning a dict of zero.shard arguments)")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"variant {spec!r}: cannot import it ({e})") from None
    out = factory()
    if not isinstance(out, dict):
        raise ValueError(f"variant {spec!r}: its factory returned {type(out).__name__}, not a "
                         f"dict of zero.shard arguments (e.g. {{'stage': 3, 'prefetch': 2}})")
    return out


def parse(text: str) -> tuple[str, str]:
    """``NAME=module:factory`` -> (NAME, "module:factory")."""
    name, eq, spec = text.partition("=")
    if not eq or not name or ":" not in spec:
        raise ValueError(f"--variant {text!r}: write NAME=module:factory")
    return name, spec


def stage(spec: str | dict) -> int:
    """The stage a variant runs (3 unless its arguments say otherwise)."""
    return int(load(spec).get("stage", 3))


@dataclass(frozen=True)
class Verdict:
    """What ``equal_to`` found: ``equal`` (within the tolerance at every step), the largest
    relative difference seen, and the first difference (step, parameter), if any."""

    equal: bool
    worst: float
    first: str | None

    def __bool__(self) -> bool:
        return self.equal


def _system(candidate, base: nn.Module, opt: str):
    from zerolab.systems import System

    if isinstance(candidate, str) and ":" not in candidate:
        return System(candidate, base, opt)  # a built-in kind
    return System("variant", base, opt, shard=load(candidate))


def _small_model() -> nn.Module:
    from zerolab.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=64, seq=8, dim=16, layers=2, heads=2))


def _difference(a: dict, b: dict) -> tuple[float, str | None]:
    """(max relative difference, the first parameter that differs at all) of two full states."""
    if a.keys() != b.keys():
        return float("inf"), f"names differ: {sorted(a.keys() ^ b.keys())}"
    worst, first = 0.0, None
    for name in a:
        if a[name].shape != b[name].shape:
            return float("inf"), f"{name}: shape {tuple(a[name].shape)} vs {tuple(b[name].shape)}"
        if not torch.equal(a[name], b[name]):
            diff = (a[name].double() - b[name].double()).abs().max()
            worst = max(worst, (diff / b[name].double().abs().max().clamp_min(1e-30)).item())
            first = first or name
    return worst, first


def _train(rank: int, n: int, candidate, reference, model: Callable, steps: int, opt: str,
           batch: int) -> list[tuple[float, str | None]]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    base = model()
    ours, ref = _system(candidate, base, opt), _system(reference, base, opt)
    out = []
    for step in range(steps):
        ours.step(rank, step, batch=batch)
        ref.step(rank, step, batch=batch)
        out.append(_difference(ours.full_params(), ref.full_params()))
    return out


def equal_to(candidate: Any, reference: Any = "ddp", *, tolerance: float = 0.0,
             model: Callable[[], nn.Module] | None = None, steps: int = 2, world_size: int = 2,
             opt: str = "adamw", batch: int = 2) -> Verdict:
    """Train ``candidate`` and ``reference`` from the same weights on the same data on
    ``world_size`` local gloo ranks, and compare their full parameters after every step.

    Args:
        candidate, reference: a kind of ``zerolab.systems`` ("ddp", "fsdp2", "zero2"...), a
            dict of ``zero.shard`` arguments, or "module:factory" returning one.
        tolerance: 0 asks for bitwise equality (``torch.equal``, the project's contract at 2
            ranks in fp32); above 0, the largest relative difference allowed (max |a - b| /
            max |b|, parameter by parameter).
        model: builds the model (one of ``zerolab.models``: ``units()``, ``batch()``,
            ``loss()``); default a 2-block GPT small enough for a test.
    """
    from zerolab.launch import run_ranks

    per_rank = run_ranks(_train, world_size, candidate, reference, model or _small_model, steps,
                         opt, batch, timeout=300)
    worst, first = 0.0, None
    for rank, steps_ in enumerate(per_rank):
        for step, (w, name) in enumerate(steps_):
            worst = max(worst, w)
            if name and first is None:
                first = f"rank {rank}, after step {step + 1}: {name}"
    equal = worst == 0.0 if tolerance == 0 else worst <= tolerance
    return Verdict(equal, worst, first)
