"""BatchNorm's running statistics drift apart across ranks (zero/core/running_stats.py).

Each rank updates its own ``running_mean`` / ``running_var`` from its own batch. With
``broadcast_buffers=False`` (FSDP2's way, zero's default) nothing brings them together: the
ranks' eval outputs differed by 0.035 after 3 steps, without a word. The default stays; the
root's first forward warns once, naming ``broadcast_buffers=True``.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import zero
from harness import run_ranks


class Normed(nn.Module):
    def __init__(self, norm: bool):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6) if norm else nn.LayerNorm(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.lin(x))))


def _train(rank, n, norm, broadcast):
    torch.manual_seed(0)
    model = Normed(norm)
    zero.shard(model.lin, stage=3)
    zero.shard(model, stage=3, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for s in range(3):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * s + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    said = [str(w.message) for w in seen if "running statistics" in str(w.message)]
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(2, 6))
    return said, out


@pytest.mark.parametrize("norm,broadcast", [(True, False), (True, True), (False, False)])
def test_running_statistics_that_drift_apart_are_named_once(norm, broadcast):
    (said0, out0), (said1, out1) = run_ranks(_train, 2, norm, broadcast)
    if norm and not broadcast:  # they drift, and the first forward says so, once
        assert not torch.equal(out0, out1)
        assert len(said0) == 1 and said0 == said1, said0
        assert "norm" in said0[0] and "broadcast_buffers=True" in said0[0], said0[0]
    else:  # rank 0's buffers everywhere (DDP's way), or none to drift: nothing to say
        assert torch.equal(out0, out1)
        assert said0 == said1 == []
