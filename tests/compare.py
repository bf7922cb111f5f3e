"""Train the same model with several systems in one rank and compare them step by step.

The systems are built by ``zerolab.systems.System`` (DDP, DDP + ZeroRedundancyOptimizer, our
stages, FSDP2 on the same units). Every system starts
from the same initial weights and sees the same per-rank data, so at world size 2 their
parameters must agree bitwise after every step (the numerical contract of notes/07-equality.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
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
        piece = zero.piece_of(p)
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


# ---- a small model and a driver for the tests of calling patterns and faults ----------------

DIM = 12


class Net(nn.Module):
    """A root ``inp`` -> blocks -> ``out``; each block is a unit, the root holds the rest."""

    def __init__(self, blocks):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(blocks)
        self.out = nn.Linear(DIM, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def units(self):
        return [*self.blocks, self]

    def batch(self, b, gen):
        return torch.randn(b, DIM, generator=gen), torch.randn(b, 3, generator=gen)

    @staticmethod
    def loss(out, y):
        return F.mse_loss(out.float(), y)


class Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def train_steps(model, opt, rank: int, steps: int, first: int = 0):
    """``steps`` steps of a ``zerolab.models`` model on this rank's batches (seeded by step and
    rank, 4 sequences); each step's loss and its ledger."""
    losses, ledgers = [], []
    for s in range(first, first + steps):
        x, y = model.batch(4, torch.Generator().manual_seed(10 * s + rank))
        with zero.Ledger() as ledger:
            loss = model.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
        ledgers.append(ledger)
    return losses, ledgers


def train_and_diff(rank, steps, systems, step=None):
    """Step every system; return what differs from systems[0] after each step."""
    failures = []
    for s in range(steps):
        for sys_ in systems:
            (step or (lambda sys_, rank, s: sys_.step(rank, s)))(sys_, rank, s)
        ref = systems[0].full_params()
        for sys_ in systems[1:]:
            if (diff := first_difference(sys_.full_params(), ref)) is not None:
                failures.append(f"{sys_.kind} after step {s}: {diff}")
    return failures


def compare(rank, n, make, ref, kinds, opts=None):
    """Train ``make()`` with ``ref`` and ``kinds``; opts: steps, step (a custom step), mp."""
    opts = dict(opts or {})
    steps, step, mp = opts.pop("steps", 3), opts.pop("step", None), opts.pop("mp", False)
    torch.manual_seed(0)
    base = make()
    systems = [System(k, base, "adamw", mp=mp) for k in [ref, *kinds]]
    return train_and_diff(rank, steps, systems, step)


def inner(sys_):
    """The model itself, inside DDP's wrapper or not."""
    return sys_.model.module if sys_.kind.startswith("ddp") else sys_.model


def batch_of(sys_, rank, step, micro=0):
    """The data of (rank, step, micro-batch), the same for every system."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return sys_.base.batch(4, gen)


ZERO = ["zero1", "zero2", "zero3"]
