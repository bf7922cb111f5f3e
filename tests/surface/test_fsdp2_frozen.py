"""FSDP2's frozen-parameter scenarios (test_fully_shard_frozen.py), ported: frozen and
trainable parameters in one unit and across units, freezing before and after sharding,
unfreezing mid-training, a no_grad iteration, frozen units called several times. Every stage
against torch's reference and ``fully_shard``, bitwise at world size 2 (tests/fsdp2_port.py).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.testing._internal.common_fsdp import MLP

import zero
from fsdp2_port import ALL, ZERO, Trainer, data, mismatches, train
from harness import run_ranks


def freeze_weights(model: nn.Module) -> None:
    """Train the biases only (BitFit), as torch's test does."""
    for name, p in model.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)


def _mixed_requires_grad_per_unit(rank, n):
    out = []
    # (reshard_after_forward, checkpointing, freeze after sharding): three of torch's twelve
    for raf, ac, after in ((True, False, False), (False, True, True), (True, True, True)):
        torch.manual_seed(42)
        base = nn.Sequential(*[MLP(8) for _ in range(3)])
        if not after:
            freeze_weights(base)

        def prepare(model, ac=ac):
            if ac:
                for mlp in model:
                    checkpoint(mlp)

        trainers = [Trainer(k, base, lambda m: [*m, m], raf=raf, prepare=prepare,
                            replicate_kw={"find_unused_parameters": after})
                    for k in ("replicate", "fsdp2", *ZERO)]
        if after:
            for t in trainers:
                freeze_weights(t.model)
        out += train(trainers, 2, lambda m, it: m(data(rank, it, 4, 8)).sum())
        # torch checks that the reductions run inside backward, not all in the final
        # callback: at stage 3 the last block's reduce-scatter precedes the first one's gather.
        if not raf:
            continue  # (no gather in backward to compare with)
        with zero.Ledger() as ledger:
            trainers[-1].backward(trainers[-1].model(data(rank, 9, 4, 8)).sum())
        ops = [(r.op, r.unit) for r in ledger.records if r.phase == "backward"]
        if ops.index(("reduce_scatter", "2")) > ops.index(("all_gather", "0")):
            out.append(f"raf={raf} ac={ac}: reduce-scatters wait for the end of backward")
    return out


@pytest.mark.full  # sampled: the port runs whole under ZERO_FULL=1
def test_train_mixed_requires_grad_per_unit():
    # Ports TestFullyShardFrozen.test_train_mixed_requires_grad_per_group (BitFit: frozen
    # weights, trainable biases, in every unit). FSDP2 reduce-scatters only the trainable
    # elements; our flat gradient is reduced whole (notes/11-conformance.md).
    assert run_ranks(_mixed_requires_grad_per_unit, 2) == [[], []]


def _mixed_requires_grad_across_units(rank, n):
    out = []
    for raf, unfreeze in ((True, False), (True, True), (False, True)):
        torch.manual_seed(42)
        base = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.ReLU())])
        linears = lambda m: [x for x in m if isinstance(x, nn.Linear)]  # noqa: E731
        # Every linear is its own root: there is no unit for the whole model. The reference
        # averages by hand: DDP does not see parameters unfrozen after it was built.
        trainers = [Trainer(k, base, linears, raf=raf) for k in ALL]
        for t in trainers:
            for lin in linears(t.model)[::2]:  # frozen, trainable, frozen, ...
                lin.requires_grad_(False)
        inp = data(rank, 0, 4, 8)
        for it in range(3):
            for t in trainers:
                if unfreeze and it == 2:  # unfreeze on the last step, as in fine-tuning
                    t.model.requires_grad_(True)
                if it == 1:
                    with torch.no_grad():
                        t.model(inp)
                else:
                    t.backward(t.model(inp).sum())
                    t.step(it)
        out += mismatches(trainers, f"raf={raf} unfreeze={unfreeze}")
    return out


def test_train_mixed_requires_grad_across_units():
    # Ports test_train_mixed_requires_grad_across_groups: alternate linears frozen (torch's
    # helper means to interleave them), a no_grad iteration, unfrozen for the last step.
    assert run_ranks(_mixed_requires_grad_across_units, 2) == [[], []]


class MultiForwardFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # the same unit again, without gradient
                x += F.relu(self.layer_with_grad(x))
        return x


def _multi_forward_mixed_requires_grad(rank, n):
    out = []
    for raf in (True, False, None):
        torch.manual_seed(42)
        base = MultiForwardFrozen()
        trainers = [Trainer(k, base, lambda m: [m.layer_0, m.layer_no_grad, m.layer_with_grad, m],
                            raf=raf) for k in ("replicate", "fsdp2", *ZERO)]
        out += train(trainers, 2, lambda m, it: m(data(rank, it, 8, 5)).sum())
    return out


def test_multi_forward_mixed_requires_grad():
    # Ports test_multi_forward_mixed_requires_grad.
    assert run_ranks(_multi_forward_mixed_requires_grad, 2) == [[], []]
