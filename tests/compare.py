"""Train the same model with several systems in one rank and compare them step by step.

The systems are built by ``zerolab.systems.System`` (DDP, DDP + ZeroRedundancyOptimizer, our
stages, FSDP2 on the same units). Every system starts
from the same initial weights and sees the same per-rank data, so at world size 2 their
parameters must agree bitwise after every step (the numerical contract, shared/DESIGN.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from zerolab.models import GPT, EncoderStack, UnevenMLP
from zerolab.systems import KINDS, System, make_optimizer  # noqa: F401  (re-exported for tests)

MODELS = {"gpt": GPT, "mlp": UnevenMLP, "encoder": EncoderStack}


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
