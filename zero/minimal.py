"""ZeRO's three stages in one file: the summary of ``notes/road/``, read after it.

The whole idea in one sentence, the observation SimpleFSDP (Zhang et al., 2024,
arXiv:2411.00284) builds FSDP on: the all-gather that assembles a unit's parameters in
forward and the reduce-scatter that splits its gradient in backward are the two directions of
one operation. ``Gather`` is that operation as an autograd function; the three stages only
decide *when* (paper §5; AG all-gather, RS reduce-scatter):

| stage      | sharded         | full tensors alive on a rank                 | per unit, step |
|------------|-----------------|----------------------------------------------|----------------|
| 1 `Stage1` | optimizer state | all params; all grads at the end of backward | 1 AG, 1 RS     |
| 2 `Stage2` | + gradients     | all params; one unit's grad at a time        | 1 AG, 1 RS     |
| 3 `Stage3` | + parameters    | the running units' params; one unit's grad   | 2 AG, 1 RS     |

A unit's parameters lie end to end in one padded flat buffer (``zero/core/flat.py``); rank r owns
the slice ``[r*S, (r+1)*S)``, and its optimizer sees nothing else. Use (fp32; every rank
builds the same model)::

    minimal.shard(model, model.blocks, stage=3)  # a unit per block, and one for the rest
    opt = torch.optim.AdamW(model.parameters())  # afterwards: it sees the shards only
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

Limits: one forward and one backward per step; every parameter trained and used; one tensor
out of each unit. Stage 1 here reduces at the end of backward, as the paper tells it; the
package reduces each unit as soon as its gradient is complete (notes/03-stage1.md says why
both are ZeRO-1). The package (``zero/core/unit.py``) computes the same bits and does more: its
flat parameter is an autograd leaf (so ``no_sync`` and frozen parameters work); it keeps names,
prefetches, reduces asynchronously, casts, makes ranks agree before they could hang, and
survives activation checkpointing. notes/00-start-here.md defines every term.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from zero import comm
from zero.core.flat import FlatLayout


class Gather(torch.autograd.Function):
    """All-gather a unit's shard in forward; in backward, the mirror: reduce-scatter its grad."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: "Unit") -> torch.Tensor:
        ctx.unit = unit
        unit.gather("forward")
        return unit.full

    @staticmethod
    def backward(ctx, full_grad: torch.Tensor):
        ctx.unit.stage.gradient_ready(ctx.unit, full_grad)  # reduce-scatter, now or later
        return None, None  # the shard's gradient is the reduce-scatter's output, set there


class Unit:
    """Some modules' parameters as one flat parameter, of which this rank keeps a slice."""

    def __init__(self, name: str, module: nn.Module, modules: list, stage, units: list):
        self.name, self.stage, self.units = name, stage, units
        self.uses, params = [], {}  # (module, attribute, index): a tied parameter has two uses
        for mod in modules:
            for attr, p in list(mod._parameters.items()):
                if p is not None:
                    self.uses.append((mod, attr, params.setdefault(p, len(params))))
                    del mod._parameters[attr]  # the module gets a view each forward instead
        self.layout = FlatLayout([p.shape for p in params], dist.get_world_size())
        s, r, flat = self.layout.shard_numel, dist.get_rank(), self.layout.flatten(list(params))
        self.shard = nn.Parameter(flat[r * s : (r + 1) * s].detach().clone())  # all that persists
        module.register_parameter("flat_shard", self.shard)  # what the optimizer will see
        self.full = self.full_grad = None
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(lambda mod, args, out: stage.after_forward(self, out))

    def pre_forward(self, module: nn.Module, args) -> None:
        views = self.layout.views(Gather.apply(self.shard, self))
        for mod, attr, i in self.uses:
            setattr(mod, attr, views[i])  # the module computes with views of the full buffer

    def gather(self, phase: str) -> None:
        if phase == "forward":
            self.full = self.shard.new_empty(self.layout.padded_numel)
        else:  # stage 3, before backward: refill the storage that free() emptied
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        # (S,) on every rank -> (N*S,) on every rank, rank r's shard at [r*S, (r+1)*S).
        # Into .data: autograd refuses saved views after a write it sees; this one restores them
        comm.all_gather(self.full.data, self.shard.detach(), unit=self.name, phase=phase)

    def free(self) -> None:
        """Give back the full parameters' bytes; views of them (saved by autograd) stay valid."""
        self.full.untyped_storage().resize_(0)

    def reduce_scatter(self, full_grad: torch.Tensor) -> None:
        self.shard.grad = torch.empty_like(self.shard)
        # (N*S,) on every rank -> (S,): this rank's slice of the mean over ranks
        comm.reduce_scatter(self.shard.grad, full_grad, op="avg", unit=self.name, phase="backward")


class Stage1:
    """ZeRO-1: each rank steps only its shard, but every full gradient waits for the end."""

    def after_forward(self, unit: Unit, output: torch.Tensor) -> None:
        pass  # the full parameters stay: backward reads them

    def gradient_ready(self, unit: Unit, full_grad: torch.Tensor) -> None:
        unit.full_grad = full_grad  # kept
        if all(u.full_grad is not None for u in unit.units):  # the last: backward is over
            for u in unit.units:
                u.reduce_scatter(u.full_grad)
                u.full_grad = None


class Stage2(Stage1):
    """ZeRO-2: + each full gradient is reduce-scattered as soon as it is complete, and freed."""

    def gradient_ready(self, unit: Unit, full_grad: torch.Tensor) -> None:
        unit.reduce_scatter(full_grad)  # then full_grad is dropped: we need only our slice


class Stage3(Stage2):
    """ZeRO-3: + full parameters freed after forward, gathered again for backward, freed."""

    def after_forward(self, unit: Unit, output: torch.Tensor) -> None:
        unit.free()
        output.register_hook(lambda grad: unit.gather("backward"))

    def gradient_ready(self, unit: Unit, full_grad: torch.Tensor) -> None:
        super().gradient_ready(unit, full_grad)
        unit.free()


def shard(model: nn.Module, blocks, stage: int) -> list[Unit]:
    """Shard ``model`` for ZeRO stage 1, 2 or 3: a unit per block, and one for the rest.

    Args:
        model: the model, the same on every rank (fp32).
        blocks: the sub-modules that become units of their own (``model.blocks``).
        stage: 1, 2 or 3.

    Returns:
        The units, blocks first. Build the optimizer afterwards from ``model.parameters()``.
    """
    rule = {1: Stage1, 2: Stage2, 3: Stage3}[stage]()
    names = {m: n for n, m in model.named_modules()}
    in_blocks = {m for block in blocks for m in block.modules()}
    units: list[Unit] = []
    for block in blocks:
        units.append(Unit(names[block], block, list(block.modules()), rule, units))
    rest = [m for m in model.modules() if m not in in_blocks]
    units.append(Unit("root", model, rest, rule, units))
    return units
