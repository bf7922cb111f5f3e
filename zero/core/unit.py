"""A unit: one module whose own parameters are sharded together as one flat parameter.

The stage decides only *when* (``zero/core/stage.py``). The all-gather that assembles the
parameters for forward is mirrored by the reduce-scatter that splits the gradient in backward
(SimpleFSDP, arXiv:2411.00284). FSDP2's parameter group; notes/05-stage3.md.

[Note: the three tensors of a unit] (notes/01-flat-parameter.md)
- ``sharded``: this rank's slice (fp32 master weights), stepped through ``params``, one 1-D
  ``nn.Parameter`` view per original parameter (FSDP1's ``use_orig_params``).
- ``unsharded``: the padded flat parameter in the compute dtype, an autograd leaf the module
  computes with through views (``layout.views``): one flat ``.grad``, one hook when complete.
- ``_unsharded_data``: the same storage under its own version counter; every all-gather writes
  through it, so a refill trips no in-place check. Stage 3 frees the storage (resized to 0 bytes).
Its ``ShardedState`` moves only in ``unshard``, ``wait_unshard``, ``reshard``, ``shard_changed``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from zero import api
from zero.comm.context import finish, label
from zero.comm.flat_collectives import DEFAULT as EXACT
from zero.core import adoption, guards, registry
from zero.core.config import MeshInfo, UnitConfig
from zero.core.flat import LocalShard
from zero.core.same_model import describe
from zero.core.grads import Gradient
from zero.core.param import ShardedParam
from zero.core.rows import CopiedOut, RowsLayout, gather_sending
from zero.core.state import Controls, Held, Iteration, ShardedState, TrainingState


class AllGather(NamedTuple):
    """An all-gather in flight, its buffers held till waited (``zero/comm/context.py``)."""

    work: api.Work  # its handle: the full parameters are readable after ``wait()``
    phase: str
    event: object  # recorded on the all-gather stream once issued (None on the CPU)
    buffers: tuple  # the shard it reads (a host-to-device copy, say), the buffer it fills


class Unit:
    """The sharded state of ``modules`` (usually one; ``zero.shard([a, b])``): the module note.
    ``locations``: each parameter's (module, attribute) slots; ``forms``: per parameter, None or
    ``make(sharded_param)``; ``root``: the per-root context (``zero/core/root.py``)."""

    def __init__(self, modules, params, locations, config: UnitConfig, mesh: MeshInfo,
                 controls: Controls, root,
                 forms: Sequence[Callable[[ShardedParam], api.ParamForm] | None] = ()):
        self.modules = modules
        self.name = "+".join(type(m).__name__ for m in modules)  # the root renames by path
        self.config, self.mesh, self.controls = config, mesh, controls
        self.parent: Unit | None = None
        self.sibling_of: Unit | None = None  # the unit made from the same modules (frozen part)
        self.root = root
        self.iteration = Iteration()
        self.layout = config.layout([p.shape for p in params], mesh.world_size)
        self.local = LocalShard(self.layout, mesh.rank)  # our slot and pieces

        self.materialized = not any(p.is_meta for p in params)
        with torch.no_grad():
            self.unsharded = torch.empty(self.layout.padded_numel, dtype=config.param_dtype,
                                         device=config.device)
            self._unsharded_data = self.unsharded.data  # (the module note)
            if config.shards_in_place and not config.comm.in_place_ok:
                raise ValueError(f"{describe(config.comm)} needs the shard apart from the full "
                                 f"buffer, but stage {config.stage.number} without a cast keeps "
                                 "it inside: use stage 3, or compute in another dtype (mp_policy)")
            if config.shards_in_place:
                self.sharded = self._unsharded_data[self.local.slot].data  # own version counter
            else:
                self.sharded = torch.empty(self.layout.shard_numel, dtype=config.master_dtype,
                                           device=config.offload.home(config.device),
                                           pin_memory=config.offload.pinned(config.device))
            self.sharded.zero_()  # the padding stays zero
            if self.materialized:
                for i, piece in self.local.pieces.items():  # only our pieces: no full copy
                    flat = params[i].detach().reshape(-1)
                    mine = flat[piece.param_offset :][: piece.length]
                    self.local.piece(self.sharded, i).copy_(mine)
        self.unsharded.requires_grad_(any(p.requires_grad for p in params))
        self.sharded_params = [
            ShardedParam(i, p.shape, locations[i], self._sharded_param(i, p),
                         getattr(self.local.pieces.get(i), "param_offset", 0),
                         None if p.is_contiguous() else p.stride())
            for i, p in enumerate(params)]
        for sp, make in zip(self.sharded_params, forms):
            if make is not None:
                sp.form = make(sp)
        self._sending = {sp.index: cast(api.SendingForm, sp.form)
                         for sp in self.sharded_params if sp.form.sends}
        self.post_backward_handle = None  # the post-accumulate-grad hook on ``unsharded``
        self.grads = Gradient(self.unsharded, self.sharded_params, self.local, self.sharded,
                              config, mesh, self.name, controls)
        self.sharded_state = ShardedState.UNSHARDED
        self._gathering: AllGather | None = None  # GATHERING: the all-gather in flight
        self._post_forward_shard: torch.Tensor | None = None  # SHARDED_POST_FORWARD (hpZ)
        # (a DTensor parameter's in-place writes bump its own version counter: watch both)
        self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]
        self._seen_version = self._versions()  # what the full parameters were made from
        self.stepped = False  # an optimizer with a parameter of this unit stepped since
        if config.stage.frees_parameters:
            self._free()

    def place_under(self, parent: "Unit", sibling: bool = False) -> None:
        """``parent`` is the unit above; a sibling (the frozen part) follows its settings."""
        self.parent = parent
        if sibling:
            self.sibling_of = parent

    def _sharded_param(self, i: int, orig: nn.Parameter) -> nn.Parameter:
        p = nn.Parameter(self.exposed_piece(self.sharded, i), requires_grad=orig.requires_grad)
        registry.mark_piece(p, self, i)
        return p

    # ---- what the unit is: its parameters ----------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        """The sharded parameters, in the unit's order (what the optimizer steps)."""
        return [sp.sharded for sp in self.sharded_params]

    @property
    def locations(self) -> list[list]:
        return [sp.locations for sp in self.sharded_params]

    def adopt_replaced(self) -> None:
        """Adopt what a client put in the slots, or refuse it (``zero/core/adoption.py``)."""
        if self.iteration.state is not TrainingState.IDLE:
            return  # (views are in the slots while the unit computes)
        if adoption.adopt_replaced(self):
            self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]
            # (sharded from meta, every parameter now replaced: the shard holds values)
            self.materialized = self.materialized or not any(p.is_meta for p in self.params)

    def params_on_meta(self) -> None:
        """Show the sharded parameters on meta, as FSDP2 does (the shard itself is real)."""
        for sp in self.sharded_params:
            shown = sp.sharded
            local = shown.to_local() if isinstance(shown, DTensor) else shown.data
            on_meta = torch.empty_like(local, device="meta")
            if isinstance(shown, DTensor):
                on_meta = DTensor.from_local(on_meta, shown.device_mesh, shown.placements,
                                             run_check=False, shape=shown.shape,
                                             stride=shown.stride())
            sp.sharded = nn.Parameter(on_meta, requires_grad=shown.requires_grad)
            registry.mark_piece(sp.sharded, self, sp.index)
            sp.use_sharded()
        self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]

    def params_on_shard(self) -> None:
        """The parameters shown on meta view the shard again (``swap_tensors``: same objects)."""
        for sp in self.sharded_params:
            if not sp.sharded.is_meta:
                continue
            real = nn.Parameter(self.exposed_piece(self.sharded, sp.index),
                                requires_grad=sp.sharded.requires_grad)
            torch.utils.swap_tensors(sp.sharded, real)
            registry.mark_piece(sp.sharded, self, sp.index)
            sp.use_sharded()
        self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]
        self._seen_version = self._versions()

    # ---- what the code around the mechanism asks (config and mesh are read here only) ------

    @property
    def group(self):
        return self.mesh.group

    @property
    def all_group(self):
        return self.mesh.all_group

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def replicated(self) -> bool:
        return self.mesh.replicated

    @property
    def stage(self) -> int:
        return self.config.stage.number

    @property
    def offload(self) -> api.OffloadPolicy:
        return self.config.offload

    @property
    def frees_parameters(self) -> bool:
        return self.config.stage.frees_parameters

    def set_reshard_after_forward(self, reshard: bool | None) -> bool:
        """Stage 3's setting (None: by the unit's role); False (nothing set) at stages 1/2."""
        if self.config.stage.keep_params:
            return False
        self.controls.reshard_after_forward = reshard
        return True

    def use_comm(self, change: Callable[[api.CommPolicy], api.CommPolicy]) -> None:
        """Collectives of ``change(policy)`` from now on (FSDP2's ``set_custom_all_gather``)."""
        self.config = dataclasses.replace(self.config, comm=change(self.config.comm))
        self.grads.use_config(self.config)

    def rename(self, name: str) -> None:
        self.name = self.grads.name = name

    def piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        return self.local.piece(shard, i)

    def exposed_piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """The same piece shown as parameter i is shown (``layout.exposed``)."""
        return self.layout.exposed(self.local.piece(shard, i), i, self.mesh.rank,
                                   self.mesh.placement)

    def attach(self, root) -> None:
        self.root = root

    @property
    def is_unsharded(self) -> bool:
        """The full buffer is allocated (readable once ``wait_unshard`` returns)."""
        return self.sharded_state in (ShardedState.GATHERING, ShardedState.UNSHARDED)

    def held(self) -> Held:
        """What this unit holds now, for observers (trackers, traces): see ``Held``."""
        g = self.grads
        return Held(self.sharded_state, self.iteration.state, self.sharded, self.unsharded,
                    self._post_forward_shard, self.unsharded.grad,
                    g.reduction.grad if g.reduction else None, g.reduced, g.unsynced)

    def storage_key(self) -> int:
        return self._unsharded_data.untyped_storage()._cdata

    # ---- parameters: unshard (all-gather) and reshard (free) -------------------------------

    def _versions(self) -> tuple[int, ...]:
        return (self.sharded._version, *(p._version for p in self._wrapped))

    def _gather(self, phase: str) -> None:
        """Start an all-gather into the (allocated) full buffer, on the context's streams."""
        self._seen_version = self._versions()  # the full parameters will show this shard
        self.stepped = False
        if self.layout.padded_numel == 0:
            self.sharded_state = ShardedState.UNSHARDED
            return
        ctx, comm = self.root.context, self.config.comm
        streams = ctx.streams(self.unsharded.device)
        copies = self.layout.copies
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:  # from the smaller group
            mesh = self.mesh.post_forward
            assert mesh is not None and self._post_forward_shard is not None  # (its state says)
            source, group, slot = self._post_forward_shard, mesh.group, mesh.slot(
                self.layout.padded_numel)
            self._post_forward_shard = None
            # forward's values (qwZ: dequantized), moved exactly, in the compute buffer's order
            comm, copies, sending = EXACT, False, {}
        else:  # (host -> device, in the master dtype, under CPU offload)
            with streams.use(streams.copy_in):
                source = self.config.offload.to_device(self.sharded, self.unsharded.device,
                                                       self.name, phase)
            group, slot, sending = self.mesh.group, self.local.slot, self._sending
        target = self._unsharded_data
        if copies:  # gathered rank-major, copied out where the parameters are
            target = self._unsharded_data.new_empty(self.layout.padded_numel)
        streams.all_gather.wait_stream(streams.copy_in)
        with streams.use(streams.all_gather), label("all_gather", self.name):
            if sending:  # (layout rows: checked at zero.shard)
                work = gather_sending(cast(RowsLayout, self.layout), target, source,
                                      sending, self.mesh.placement, group=group,
                                      unit=self.name, phase=phase, ctx=ctx)
            else:  # (hpZ is stage 3, where the shard is never inside the full buffer)
                work = comm.all_gather(target, source, slot,
                                       in_place=self.config.shards_in_place, group=group,
                                       unit=self.name, phase=phase, ctx=ctx)
            event = streams.all_gather.record_event()
        if copies:
            work = CopiedOut(work, self.layout, target, self._unsharded_data)
        self._gathering = AllGather(work, phase, event, (source, target))
        self.sharded_state = ShardedState.GATHERING

    def unshard(self, phase: str, async_op: bool = False) -> None:
        """Make the full parameters readable (``async_op``: only start the gather, a prefetch)."""
        if not self.materialized:
            raise RuntimeError(
                f"unit {self.name} was sharded from the meta device and has no values yet: "
                "call zero.init_parameters(model, init_fn) before the first forward")
        if not self.is_unsharded:
            self._unsharded_data.untyped_storage().resize_(
                self.layout.padded_numel * self._unsharded_data.element_size())
            self._gather(phase)
        if not async_op:
            self.wait_unshard()

    def prefetch(self, phase: str) -> None:
        """Start gathering ahead of need, if there is any (FSDP2's ``_prefetch_unshard``)."""
        if not self.config.stage.frees_parameters or (
                phase == "backward" and not self.controls.unshard_in_backward):
            return
        with label(f"{phase}_prefetch for {self.name}"):
            self.unshard(phase=phase, async_op=True)

    def wait_unshard(self) -> None:
        """End the gather in flight: the computing stream waits for it; its buffers may go."""
        if self.sharded_state is ShardedState.GATHERING:
            gathering, self._gathering = self._gathering, None
            assert gathering is not None  # (GATHERING: a gather is in flight)
            with label("all_gather_copy_out", self.name):  # (FSDP2's name: wait, copy out)
                self.root.context.streams(self.unsharded.device).wait(gathering.event)
                finish(gathering.work)
            self.sharded_state = ShardedState.UNSHARDED

    def shard_written(self) -> bool:
        """Whether the shard changed since the last gather (not through ``p.data``)."""
        return self.stepped or self._versions() != self._seen_version

    def mark_stepped(self) -> None:
        """An optimizer stepped this unit (``zero/surface/attach.py``): refresh at next forward."""
        if self.unsharded.requires_grad:  # (frozen units are never stepped)
            self.stepped = True

    def reshard(self, after_forward: bool = False) -> None:
        """Stage 3: free the full parameters (hpZ after forward: SHARDED_POST_FORWARD)."""
        if self.config.stage.keep_params or self.controls.pinned or not self.is_unsharded:
            return
        self.wait_unshard()
        kept = None
        if after_forward and self.mesh.post_forward is not None:
            kept = self._unsharded_data[self.mesh.post_forward.slot(
                self.layout.padded_numel)].clone()
        self._free()
        if kept is not None:
            self._post_forward_shard = kept
            self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _free(self) -> None:
        self._unsharded_data.untyped_storage().resize_(0)
        for sp in self.sharded_params:  # (what a parameter's own form holds: param.py)
            sp.free_unsharded()
        self.sharded_state = ShardedState.SHARDED

    def drop_post_forward_shard(self) -> None:
        """hpZ: the post-forward shard will not be used."""
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            self._post_forward_shard, self.sharded_state = None, ShardedState.SHARDED

    def shard_changed(self, phase: str = "step") -> None:
        """New values in the shard (written after ``wait_unshard()``): refresh or drop the full."""
        self.materialized = True
        self.stepped = False
        self.drop_post_forward_shard()  # made from the old values
        if self.config.stage.keep_params or (self.controls.pinned and self.is_unsharded):
            self.wait_unshard()
            self._gather(phase=phase)
        else:
            self.reshard()

    # ---- which tensors the module computes with --------------------------------------------

    def use(self, tensors: list[torch.Tensor]) -> None:
        """Put ``tensors`` (one per parameter) wherever the module uses the parameters."""
        for sp, t in zip(self.sharded_params, tensors):
            sp.use(t)

    def use_sharded_params(self) -> None:
        for sp in self.sharded_params:
            sp.use_sharded()

    def __deepcopy__(self, memo):
        guards.deepcopy(self)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point forward input, in the compute dtype (mixed precision)."""
        return t.to(self.config.param_dtype) if t.is_floating_point() else t

    def cast_output(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point forward output, in ``MixedPrecision.output_dtype``."""
        return t.to(self.config.output_dtype) if t.is_floating_point() else t

    def release_after_backward(self) -> None:
        """Sharded parameters back in the module; stage 3 frees the full ones (if set)."""
        self.use_sharded_params()
        if self.controls.reshard_after_backward:
            self.reshard()

    def end_iteration(self) -> None:
        """Back to IDLE: sharded parameters in the module; stage 3 frees the full ones."""
        self.use_sharded_params()
        self.iteration = Iteration()  # IDLE; the next iteration makes new views
        if self.controls.reshard_after_backward:
            self.reshard()
        self.drop_post_forward_shard()  # (hpZ: a forward whose backward never came)

    @property
    def reshard_after_forward(self) -> bool:
        setting = self.controls.reshard_after_forward
        if self.sibling_of is not None and setting is None:
            return self.sibling_of.reshard_after_forward
        return self.config.stage.reshards_after_forward(setting, is_root=self.parent is None)
