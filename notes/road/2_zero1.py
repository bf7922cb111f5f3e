"""Step 2 of 5: ZeRO-1, the optimizer state sharded.  python notes/road/2_zero1.py

An all-reduce is a reduce-scatter followed by an all-gather. ZeRO-1 puts the optimizer step
between the two: rank r keeps the mean gradient of its slice [r*S, (r+1)*S) of each flat
parameter only, steps only that slice (so its optimizer state is 1/N of DDP's), and the next
forward all-gathers the updated slices. The same bytes as DDP's all-reduce (2R), a 1/N of the
optimizer state. ZeRO paper §5.1 (P_os). The reduce-scatters wait for the end of backward, as
the paper tells it; the package starts each as soon as its unit's gradient is complete.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from zero import comm
from zero.core.flat import FlatLayout


class Gather(torch.autograd.Function):
    """A unit's full flat parameter in forward; its full flat gradient in backward."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        unit.gather("forward")
        return unit.full

    @staticmethod
    def backward(ctx, full_grad):
        unit = ctx.unit
        unit.full_grad = full_grad  # kept until backward is over
        if all(u.full_grad is not None for u in unit.units):  # the last unit's: it is over
            for u in unit.units:
                u.reduce(u.full_grad)
                u.full_grad = None
        return None, None  # the shard's gradient is set by reduce()


class Unit:
    """Some modules' parameters as one flat parameter, of which this rank keeps a slice."""

    def __init__(self, name, module, modules, units):
        self.name, self.units = name, units
        self.uses, params = [], {}  # (module, attribute, index): a tied parameter has two uses
        for mod in modules:
            for attr, p in list(mod._parameters.items()):
                if p is not None:
                    self.uses.append((mod, attr, params.setdefault(p, len(params))))
                    del mod._parameters[attr]  # the module gets a view each forward instead
        self.layout = FlatLayout([p.shape for p in params], dist.get_world_size())
        flat = self.layout.flatten(list(params)).detach()
        s, r = self.layout.shard_numel, dist.get_rank()
        self.shard = nn.Parameter(flat[r * s : (r + 1) * s].clone())  # what the optimizer steps
        module.register_parameter("flat_shard", self.shard)
        self.full = self.full_grad = None
        module.register_forward_pre_hook(self.pre_forward)

    def pre_forward(self, module, args):
        views = self.layout.views(Gather.apply(self.shard, self))
        for mod, attr, i in self.uses:
            setattr(mod, attr, views[i])  # the module computes with views of the full buffer

    def gather(self, phase):
        self.full = self.shard.new_empty(self.layout.padded_numel)
        # (S,) on every rank -> (N*S,) on every rank, rank r's shard at [r*S, (r+1)*S)
        comm.all_gather(self.full, self.shard.detach(), unit=self.name, phase=phase)

    def reduce(self, full_grad):
        self.shard.grad = torch.empty_like(self.shard)
        # (N*S,) on every rank -> (S,): this rank's slice of the mean over ranks
        comm.reduce_scatter(self.shard.grad, full_grad, op="avg", unit=self.name, phase="backward")


def shard(model, blocks):
    """A unit per block, and one for the rest of the model; returns them, blocks first."""
    names = {m: n for n, m in model.named_modules()}
    in_blocks = {m for block in blocks for m in block.modules()}
    units = []
    for block in blocks:
        units.append(Unit(names[block], block, list(block.modules()), units))
    units.append(Unit("root", model, [m for m in model.modules() if m not in in_blocks], units))
    return units


if __name__ == "__main__":
    import common

    common.main(shard, __file__)
