"""``zerolab.measure.CommBytes``: the bytes of every collective, counted at the dispatcher, on
models whose forward calls one module object several times.

transformers 5.25 turned ``apply_rotary_pos_emb`` into one module object, shared by every
attention layer of every Llama-family model in the process. torch's ``CommDebugMode`` module
tracking hooks a module again each time it is called and pops its parent once per hook, so a
module called twice in one forward empties its stack (``IndexError`` at ``_comm_mode.py:106``)
and leaves hooks behind. CommBytes counts without tracking modules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks
from zerolab.measure import CommBytes

SHARED = nn.Identity()  # one module object, called by every layer (as transformers 5.25's rotary)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return SHARED(self.lin(x))


def _count(rank: int, n: int) -> tuple[dict, int]:
    model = nn.Sequential(Layer(), Layer(), Layer())
    x = torch.randn(2, 4)
    with CommBytes(n) as comm:
        model(x).sum().backward()
        for p in model.parameters():  # DDP's all-reduce, by hand: 2(N-1)/N of each gradient
            dist.all_reduce(p.grad)
    model(x)  # after the mode: nothing of it may be left on the modules
    left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in (SHARED, *model.modules()))
    return dict(comm.sent), left


def test_a_module_called_by_every_layer_is_counted_and_left_clean():
    sent, left = run_ranks(_count, 2)[0]
    grads = sum(p.numel() * 4 for p in nn.Sequential(Layer(), Layer(), Layer()).parameters())
    assert sent == {"all_reduce": grads}  # 2(N-1)/N = 1 at N = 2
    assert left == 0
