"""Exercise 5: write ZeRO-3 from ZeRO-2.  python notes/exercises/check.py 5

A copy of road step 3 (ZeRO-2): every rank still keeps every unit's full parameters, from
the first forward to the end of training. Make it ZeRO-3: a unit's full parameters exist only
while something needs them, that is, during its forward and again during its backward. Three
facts you will need (the start page's glossary has each):

- ``t.untyped_storage().resize_(0)`` gives back a tensor's bytes but keeps the tensor, and so
  every view of it that autograd saved for backward; ``resize_(nbytes)`` gets them back,
  with garbage in them.
- A hook on a unit's forward output (``output.register_hook``) runs when backward reaches it,
  before any of the unit's own backward.
- Autograd counts every in-place write it sees to a tensor it saved, and refuses to use the
  tensor after one; a write to ``t.data`` is one it does not see.

Keep the bits (the check compares every parameter with DDP's after every step), keep no full
parameters after the step, and let no more than the root and one block hold full parameters
as that block computes.
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
        ctx.unit.reduce(full_grad)  # now; then full_grad is dropped: we keep our slice only
        # TODO (exercise 5): and the full parameters?
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
        self.full = None
        module.register_forward_pre_hook(self.pre_forward)
        # TODO (exercise 5): something must happen when the unit's forward is over.

    def pre_forward(self, module, args):
        views = self.layout.views(Gather.apply(self.shard, self))
        for mod, attr, i in self.uses:
            setattr(mod, attr, views[i])  # the module computes with views of the full buffer

    def gather(self, phase):
        # TODO (exercise 5): in backward, the unit's tensor already exists, and autograd
        # saved views of it; refill it rather than replace it, where autograd won't object.
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


if __name__ == "__main__":  # the road's report on this file; the check is check.py 5
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "road"))
    import common  # notes/road/common.py

    common.main(shard, __file__)
