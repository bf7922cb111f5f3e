"""Solution to exercise 1: ZeRO-1 that reduce-scatters in place.  python notes/exercises/check.py 1

A copy of road step 2 (ZeRO-1). Stage 1 keeps every unit's full gradient until backward is
over, and then reduce-scatters each into a new (S,) buffer: at that moment a rank holds the
full gradients (4Ψ bytes) and the shards (4Ψ/N) at once. Make ``reduce`` write this rank's
slice of the mean into its own slot of the full gradient, and give the shard that slot as its
gradient.
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
        s, r = self.layout.shard_numel, dist.get_rank()
        self.shard.grad = full_grad[r * s : (r + 1) * s]  # our slot: no memory of its own
        # (N*S,) on every rank -> (S,), in place: our slot gets our slice of the mean over ranks
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

