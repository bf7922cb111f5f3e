"""FSDP2's autograd scenarios (test_fully_shard_autograd.py), ported: forward outputs unused by
the loss, a unit that never runs, activations wrapped in lists, tuples, named tuples and dicts,
and two backwards through one retained graph. Every stage against torch's reference and
``fully_shard``, bitwise at world size 2 (tests/fsdp2_port.py).

torch's reference runs the global batch on one replica and divides the gradients by the world
size; ours runs each rank's batch and averages, which is the same reference and can be
compared bitwise.
"""

import collections

import pytest
import torch
import torch.nn as nn
from torch.testing._internal.common_fsdp import DoubleLinear

from fsdp2_port import ALL, Trainer, data, mismatches, train
from harness import run_ranks


def _unused_forward_output(rank, n):
    out = []
    for raf in (True, False, None):
        torch.manual_seed(42)
        base = DoubleLinear(8, use_second_linear=True)
        trainers = [Trainer(k, base, lambda m: [m.lin1, m], raf=raf) for k in ALL]

        def loss_of(m, it):
            out1, out2 = m(data(rank, it, 2, 8))
            return (out1 * out2).sum() if it < 2 else out1.sum()  # then out2 goes unused

        out += train(trainers, 4, loss_of, every=True)
    return out


def test_unused_forward_output():
    # Ports TestFullyShardAutograd.test_unused_forward_output.
    assert run_ranks(_unused_forward_output, 2) == [[], []]


def _unused_forward_module(rank, n):
    out = []
    for raf in (True, False, None):
        torch.manual_seed(42)
        base = DoubleLinear(8, use_second_linear=False)  # lin2 is a unit that never runs
        trainers = [Trainer(k, base, lambda m: [m.lin1, m.lin2, m], raf=raf) for k in ALL]
        out += train(trainers, 2, lambda m, it: m(data(rank, it, 2, 8)).sum())
    return out


def test_unused_forward_module():
    # Ports test_unused_forward_module: lin2's gradient stays None everywhere.
    assert run_ranks(_unused_forward_module, 2) == [[], []]


NT = collections.namedtuple("NT", "x y")


class Wrapped(nn.Module):
    """Runs on the first tensor of its (container) input and returns the same container."""

    def __init__(self, dim=8):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def f(self, x):
        return torch.relu(self.lin2(torch.relu(self.lin1(x))))

    def forward(self, inp):
        if isinstance(inp, list):
            return [self.f(inp[0])]
        if isinstance(inp, NT):
            return NT(self.f(inp.x), inp.y)
        if isinstance(inp, tuple):
            return (self.f(inp[0]),)
        return {"x": self.f(inp["x"])}


class ToContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return {"list": [x], "namedtuple": NT(x, torch.ones_like(x)), "tuple": (x,),
                "dict": {"x": x}}[self.kind]


class FromContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return x["x"] if self.kind == "dict" else x[0]


def _nontensor_activations(rank, n):
    out = []
    for kind in ("list", "namedtuple", "tuple", "dict"):
        torch.manual_seed(42)
        base = nn.Sequential(ToContainer(kind), *[Wrapped() for _ in range(3)],
                             FromContainer(kind))
        trainers = [Trainer(k, base, lambda m: [*m, m]) for k in ALL]
        out += [f"{kind}: {line}" for line in
                train(trainers, 2, lambda m, it: m(data(rank, it, 2, 8)).sum())]
    return out


def test_nontensor_activations():
    # Ports test_nontensor_activations (list, namedtuple, tuple, dict between units).
    assert run_ranks(_nontensor_activations, 2) == [[], []]


def _backward_twice(rank, n):
    out = []
    for raf in (True, False, None):
        torch.manual_seed(42)
        base = nn.Sequential(nn.Linear(8, 8), DoubleLinear(8))
        trainers = [Trainer(k, base, lambda m: [m[0], m[1].lin1, m[1].lin2, m], raf=raf)
                    for k in ALL]
        for it in range(2):
            for t in trainers:
                loss1, loss2 = t.model(data(rank, it, 4, 8))
                loss2.sum().backward(retain_graph=True)  # reduces once here ...
                t.backward(loss1.sum())  # ... and again here; "ref" averages the sum once
            out += mismatches(trainers, f"raf={raf} iteration {it}", grads=True, exact=False)
            out += mismatches(trainers[1:], f"raf={raf} iteration {it}", grads=True)
            for t in trainers:
                t.step(it)
    return out


@pytest.mark.full  # sampled: the port runs whole under ZERO_FULL=1
def test_backward_twice_through_a_retained_graph():
    # Ports the parity half of test_fully_shard_comm.py's
    # TestFullyShardPrefetch._test_backward_prefetch_unused_in_backward: two outputs, a backward
    # through one with retain_graph, then through the other (the shared first unit in both).
    assert run_ranks(_backward_twice, 2) == [[], []]
