"""A parameter that is not contiguous (``nn.Parameter(w.t())``): FSDP2 refuses it; zero
shards it and the module computes with a tensor in the parameter's own strides, so training
is bitwise DDP's (a view into the flat buffer is contiguous, and with it a linear layer's
forward or input gradient rounds otherwise at some shapes: the first case here)."""

import pytest
import torch
import torch.nn as nn

from conftest import sample
from harness import run_ranks


def _transposed(rank: int, n: int, stage: int, layout: str, dims: tuple):
    import zero
    from zerolab.systems import average_gradients

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.Tanh(), nn.Linear(dims[1], dims[2]))
        m[2].weight = nn.Parameter(m[2].weight.detach().t().contiguous().t())
        return m

    ours, ref = make(), make()
    zero.shard(ours[0], stage=stage, layout=layout)
    zero.shard(ours, stage=stage, layout=layout)
    strides = []
    ours.register_forward_pre_hook(lambda m, a: strides.append(m[2].weight.stride()))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, ref)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, dims[0], generator=g)
        for m, opt in zip((ours, ref), opts):
            m(x).square().sum().backward()
            if m is ref:
                average_gradients(ref)
            opt.step()
            opt.zero_grad()
    full = zero.full_state_dict(ours)
    return strides, ref[2].weight.stride(), \
        [k for k, v in ref.state_dict().items() if not torch.equal(full[k], v)]


@pytest.mark.parametrize("stage,layout,dims", sample(
    [(1, "flat", (64, 300, 40))], [(3, "flat", (16, 32, 8)), (3, "rows", (64, 96, 24))]))
def test_a_transposed_parameter_trains_bitwise_like_ddp(stage, layout, dims):
    for strides, original, differ in run_ranks(_transposed, 2, stage, layout, dims):
        assert original == (1, dims[2]) and strides == [original] * 3  # what forward used
        assert differ == []
