"""Solution to exercise 5: ZeRO-3 from ZeRO-2.  python notes/exercises/check.py 5

Road step 4, which this is: ``post_forward`` frees the unit and hooks its output so that
backward gathers it again first; ``gather`` refills the emptied storage through ``.data``;
``Gather.backward`` frees the unit once its gradient is reduced.

A module backward pre-hook (``module.register_full_backward_pre_hook``) in place of the hook on
the output is right too, and the check accepts it: it runs at the same moment, once the
gradient with respect to the module's output is complete. notes/road/README.md says why the
road and FSDP2 hook the output tensor instead.
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
        ctx.unit.free()  # backward is done with the unit's parameters
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
        module.register_forward_hook(self.post_forward)

    def pre_forward(self, module, args):
        views = self.layout.views(Gather.apply(self.shard, self))
        for mod, attr, i in self.uses:
            setattr(mod, attr, views[i])  # the module computes with views of the full buffer

    def post_forward(self, module, args, output):
        self.free()
        output.register_hook(lambda grad: self.gather("backward"))  # before the unit's backward

    def gather(self, phase):
        if phase == "forward":
            self.full = self.shard.new_empty(self.layout.padded_numel)
        else:  # refill the storage that free() emptied
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        # (S,) on every rank -> (N*S,) on every rank, rank r's shard at [r*S, (r+1)*S).
        # Into .data: autograd refuses saved views after a write it sees; this one restores them
        comm.all_gather(self.full.data, self.shard.detach(), unit=self.name, phase=phase)

    def free(self):
        """Give back the full parameters' bytes; views of them (saved by autograd) stay valid."""
        self.full.untyped_storage().resize_(0)

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

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "road"))
    import common  # notes/road/common.py

    common.main(shard, __file__)
