"""Step 1 of 5: naive data parallel, where the road starts.  python notes/road/1_ddp.py

Every rank holds the whole model and the whole optimizer state and takes the same step;
after backward, every gradient is all-reduced to its mean over the ranks (torch's DDP does
the same, bucket by bucket). Built the way the next steps need it: a unit's parameters are
one flat tensor (zero/core/flat.py), and ``Gather`` hands a unit its full parameter in forward
and takes its full gradient in backward. DDP has nothing to gather: the "shard" is it all.
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
    """Some modules' parameters as one flat parameter."""

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
        self.shard = nn.Parameter(flat.clone())  # what the optimizer steps: all of it
        module.register_parameter("flat_shard", self.shard)
        self.full = self.full_grad = None
        module.register_forward_pre_hook(self.pre_forward)

    def pre_forward(self, module, args):
        views = self.layout.views(Gather.apply(self.shard, self))
        for mod, attr, i in self.uses:
            setattr(mod, attr, views[i])  # the module computes with views of the full buffer

    def gather(self, phase):
        self.full = self.shard.detach()  # every rank has every parameter already

    def reduce(self, full_grad):
        self.shard.grad = full_grad
        # (N*S,) on every rank -> the same, in place: the mean over ranks
        comm.all_reduce(self.shard.grad, op="avg", unit=self.name, phase="backward")


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
