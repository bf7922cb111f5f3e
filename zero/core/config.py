"""What ``zero.shard`` decided for one unit, in two frozen objects: its config and its mesh.

FSDP2's split: the policies (``UnitConfig``) and who a unit talks to (``MeshInfo``, FSDP2's
``FSDPMeshInfo``; ``HSDPMeshInfo``; hpZ's ``post_forward``). Nothing changes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zero import api
from zero.comm.context import CommContext
from zero.core.stage import Stage


@dataclass(frozen=True)
class UnitConfig:
    """The policies of one unit (every unit's alike, but for the dtypes)."""

    stage: Stage  # ``zero/core/stage.py``
    master_dtype: torch.dtype  # the shard's
    param_dtype: torch.dtype  # the compute dtype
    reduce_dtype: torch.dtype  # the reduction's
    cast_inputs: bool  # cast floating inputs to ``param_dtype``
    output_dtype: torch.dtype | None  # cast floating outputs to this
    layout: type[api.Layout]  # the ``Layout`` class
    comm: api.CommPolicy
    offload: api.OffloadPolicy
    device: torch.device  # the compute device

    @classmethod
    def make(cls, stage: Stage, mp_policy, master_dtype: torch.dtype,
             layout: type[api.Layout], comm: api.CommPolicy, offload: api.OffloadPolicy,
             device) -> "UnitConfig":
        """The dtypes follow FSDP2's defaults (None: the parameters', then ``param_dtype``)."""
        param_dtype = (mp_policy and mp_policy.param_dtype) or master_dtype
        reduce_dtype = (mp_policy and mp_policy.reduce_dtype) or param_dtype
        cast = (mp_policy is not None and mp_policy.param_dtype is not None
                and getattr(mp_policy, "cast_forward_inputs", True))
        return cls(stage, master_dtype, param_dtype, reduce_dtype, cast,
                   getattr(mp_policy, "output_dtype", None), layout, comm, offload,
                   torch.device(device))

    @property
    def shards_in_place(self) -> bool:
        """The shard inside the full buffer: the stage's rule, no layout copy, no offload."""
        return (self.stage.shards_in_place(self.param_dtype, self.master_dtype)
                and not self.layout.copies and self.offload.on_device)

    @property
    def keeps_full_gradient(self) -> bool:
        return self.stage.keeps_full_gradient(self.param_dtype, self.reduce_dtype,
                                              self.master_dtype)


@dataclass(frozen=True)
class MeshInfo:
    """The ranks a unit is sharded over (``group``), and who else it talks to."""

    group: Any  # the process group the unit is sharded over (None: the world)
    rank: int
    world_size: int
    all_group: Any  # every rank training (the agreement's group; HSDP's whole mesh)
    placement: Any  # the mesh DTensor parameters are placed on (layout "rows"), else ``group``
    post_forward: "MeshInfo | None" = None  # hpZ: this rank's node, from which backward gathers
    replicas: int = 1  # HSDP's copies of the sharded model (``HSDPMeshInfo``)

    @classmethod
    def over(cls, ctx: api.Comm, group, all_group=None, placement=None, post_forward=None,
             **kw) -> "MeshInfo":
        """The unit's place in ``group``, as ``ctx``'s backend answers it."""
        return cls(group, ctx.rank(group), ctx.world_size(group),
                   group if all_group is None else all_group,
                   group if placement is None else placement, post_forward, **kw)

    def slot(self, padded_numel: int) -> slice:
        """This rank's slice of a (padded_numel,) buffer cut in ``world_size`` equal parts."""
        size = padded_numel // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    replicated = False  # HSDP's replicas: none

    def reduce_replicas(self, shard: torch.Tensor, op: str, comm: api.CommPolicy, unit: str,
                        ctx: CommContext) -> None:
        """Average a reduced gradient shard over the replicas: here there are none."""


@dataclass(frozen=True)
class HSDPMeshInfo(MeshInfo):
    """HSDP: shard within ``group`` (a node); average across ``replicate_group``."""

    replicate_group: Any = None
    replicated = True

    def reduce_replicas(self, shard: torch.Tensor, op: str, comm: api.CommPolicy, unit: str,
                        ctx: CommContext) -> None:
        # HSDP: (S,) -> (S,), averaged over the replicas, on the all-reduce stream (FSDP2's)
        streams = ctx.streams(shard.device)
        with streams.use(streams.all_reduce):
            comm.all_reduce(shard, op=op, group=self.replicate_group, unit=unit,
                            phase="backward", ctx=ctx)
        streams.join(streams.all_reduce)
