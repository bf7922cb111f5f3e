"""Why "was this parameter used?" must be agreed on by all ranks before gradients are handed out.

    python notes/figures/unused_agreement.py > notes/figures/unused_agreement.txt

A two-layer model takes its second layer only when the batch says so: rank 0's batch does,
rank 1's does not. At N = 2 the flat layout puts layer ``b`` entirely in rank 1's shard, so
the rank that owns ``b``'s optimizer state is the rank that did not use it. We train one SGD
step with DDP(find_unused_parameters=True), with zero.shard (stage 2), and with zero.shard
whose used-flags all-reduce is switched off (monkeypatched to a no-op, for this
demonstration only), and compare the parameters.
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from zero.comm import CommContext
from zerolab.launch import run_ranks


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if x[0, 0] > 0 else h  # data-dependent: only some ranks use b


def train_one_step(rank, n, kind):
    torch.manual_seed(0)
    model = Branchy()
    if kind == "ddp":
        model = DDP(model, find_unused_parameters=True)
    else:
        zero.shard(model, stage=2)
        if kind == "zero, no agreement":  # the used-flags all-reduce is the one with unit="root"
            real = CommContext.all_reduce
            CommContext.all_reduce = lambda ctx, t, **kw: (None if kw.get("unit") == "root"
                                                           else real(ctx, t, **kw))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    x[0, 0] = 1.0 if rank == 0 else -1.0  # rank 0 takes the branch through b, rank 1 does not
    model(x).pow(2).sum().backward()
    grads = {name: (None if p.grad is None else list(p.grad.shape))
             for name, p in model.named_parameters()}
    opt.step()
    if kind == "ddp":
        return grads, {k: v.detach().clone() for k, v in model.module.named_parameters()}
    return grads, zero.full_state_dict(model)


def main():
    results = {k: run_ranks(train_one_step, 2, k) for k in ("ddp", "zero", "zero, no agreement")}
    ref = results["ddp"][0][1]
    for kind, per_rank in results.items():
        print(f"{kind}:")
        for rank, (grads, _) in enumerate(per_rank):
            print(f"  rank {rank} p.grad shapes after backward: {grads}")
        params = per_rank[0][1]
        print("  equal to DDP after the step: " + ", ".join(
            f"{k} {torch.equal(params[k], ref[k])}" for k in ref))


if __name__ == "__main__":
    main()
