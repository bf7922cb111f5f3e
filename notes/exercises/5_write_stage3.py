"""Exercise 5: write ZeRO-3 from ZeRO-2.  python notes/exercises/check.py 5

Do it after road step 3 and before step 4, which is its solution. This file is road step 3
(ZeRO-2): every rank keeps every unit's full parameters from the first forward to the end of
training. Make it ZeRO-3: a unit's full parameters exist only while something needs them.
The check says what it sees and what is still missing; run it after each change.

Questions to answer on the way (the start page's glossary has the tools, not the answers:
its section "Words used everywhere"):

1. When is a unit done with its full parameters in forward, and what in ``torch.nn.Module``
   lets the unit act at that moment?
2. How can a rank give back the bytes of a tensor that autograd saved views of for backward,
   without breaking those views?
3. Backward needs the values again. What is the first moment backward reaches a unit, before
   any of its own gradient is computed, and what can run code at that moment?
4. When the values come back, can you write them without autograd noticing? Try the plain way
   first and read what the check reports.
5. When is backward done with the unit's parameters for good?

Keep the bits (the check compares every parameter with DDP's after every step), keep no full
parameters after the step, and let no more than the root and one block hold full parameters
as that block computes (the root computes through the whole forward: exercise 5 in
notes/exercises/README.md says why).
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
        # TODO (exercise 5): does anything still need the unit's full parameters now?
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
        # TODO (exercise 5): nothing here acts when the unit's forward is over (question 1),
        # nor when backward reaches the unit (question 3).

    def pre_forward(self, module, args):
        views = self.layout.views(Gather.apply(self.shard, self))
        for mod, attr, i in self.uses:
            setattr(mod, attr, views[i])  # the module computes with views of the full buffer

    def gather(self, phase):
        # TODO (exercise 5): called again in backward, which tensor must the values land in
        # for the views forward handed out (and autograd saved) to see them? (question 4)
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
