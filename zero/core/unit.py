"""A unit: one module whose own parameters are sharded together as one flat parameter.

ZeRO stages 1, 2 and 3 are one mechanism here; the stage only decides *when* things happen
(``zero/core/stage.py``: the whole difference is a table of two booleans). The whole
algorithm is a symmetry: the all-gather that assembles a unit's parameters for its forward is
mirrored by the reduce-scatter that splits its gradient in backward (SimpleFSDP's summary of
FSDP: Zhang et al., "SimpleFSDP", arXiv:2411.00284).

[Note: the three tensors of a unit]
- ``sharded``: this rank's slice of the padded flat parameter, in the parameters' own dtype
  (fp32 master weights). The optimizer updates it, through ``params``: one new
  ``nn.Parameter`` per original parameter, a 1-D view of that parameter's piece of
  ``sharded`` (FSDP1's ``use_orig_params``). They keep the original names in the module.
- ``unsharded``: the whole padded flat parameter in the compute dtype, an autograd leaf.
  While the unit computes, the module's parameters are swapped for views into it
  (``layout.views``), so autograd accumulates every parameter's gradient into one flat
  ``unsharded.grad``, and a post-accumulate-grad hook on the leaf fires once per backward
  when the unit's gradient is complete.
- ``_unsharded_data``: the same storage as ``unsharded`` under its own version counter. Every
  write (all-gather) goes through it, so refilling storage that autograd saved for backward
  does not trip autograd's in-place check.
Stage 3 frees ``unsharded`` between uses by resizing its storage to 0 bytes; the views saved
in the autograd graph stay valid because the same storage is refilled before backward, and
``zero/core/saved_tensors.py`` raises if backward ever reaches them while it is empty.

A unit is FSDP2's parameter group: what it holds is split among a few objects, each with
one concern, so that a new capability has a home that is not this class:

- ``config`` and ``mesh`` (``zero/core/config.py``): what ``zero.shard`` decided, frozen: the
  stage, dtypes, layout, comm and offload policies; the ranks it talks to (HSDP, hpZ);
- ``sharded_params`` (``zero/core/param.py``): one object per original parameter, its
  module slots and its sharded ``nn.Parameter``;
- ``grads`` (``zero/core/grads.py``): the gradient half, from autograd's flat ``.grad`` to
  the parameters' ``.grad``;
- ``iteration`` and ``controls`` (``zero/core/state.py``): what the unit knows of the current
  iteration (written by ``zero/core/hooks.py`` only, made anew when it ends), and the user's
  settings (FSDP2's controls).

What the unit holds of its parameters is one ``ShardedState``, moved only by ``unshard``,
``wait_unshard``, ``reshard`` and ``shard_changed`` below. When each of these things happens
is ``zero/core/hooks.py`` (the life of a unit in one iteration) and ``zero/core/schedule.py``
(prefetching, the order of reductions). ``held()`` tells an observer what the unit holds.
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
    """An all-gather in flight into the unit's full buffer (``ShardedState.GATHERING``), and
    what must stay alive until the computing stream has waited for it (``zero/comm/context.py``'s
    note on streams): the tensors its side streams and the collective read and write."""

    work: api.Work  # its handle: the full parameters are readable after ``wait()``
    phase: str
    event: object  # recorded on the all-gather stream once issued (None on the CPU)
    buffers: tuple  # the shard it reads (a host-to-device copy, say), the buffer it fills


class Unit:
    """The sharded state of one ``zero.shard``-ed module (see the module note).

    Args:
        modules: the modules sharded together (usually one).
        params, locations: the unit's parameters, and per parameter every (module,
            attribute) that uses it.
        config: the unit's policies (``UnitConfig``); mesh: who it talks to (``MeshInfo``).
        controls: the user's settings (``Controls``): ``reshard_after_forward`` and the rest.
        root: the per-root context it belongs to (``zero/core/root.py``): its comm context,
            schedule and reductions; the root's ``zero.shard`` call takes it over later.
        forms: per parameter, None or ``make(sharded_param) -> ParamForm``: its own form
            (tensor parallel, a tensor subclass's all-gather), chosen as the unit is built.
    """

    def __init__(self, modules, params, locations, config: UnitConfig, mesh: MeshInfo,
                 controls: Controls, root,
                 forms: Sequence[Callable[[ShardedParam], api.ParamForm] | None] = ()):
        self.modules = modules  # usually one; zero.shard([a, b]) makes one unit of several
        self.name = "+".join(type(m).__name__ for m in modules)  # the root renames by path
        self.config, self.mesh, self.controls = config, mesh, controls
        self.parent: Unit | None = None
        self.sibling_of: Unit | None = None  # the unit made from the same modules (frozen part)
        self.root = root  # the per-root context (zero/core/root.py), re-pointed by the root's
        self.iteration = Iteration()
        self.layout = config.layout([p.shape for p in params], mesh.world_size)
        self.local = LocalShard(self.layout, mesh.rank)  # our slot and pieces

        # A module built on the meta device has no values yet: zero.init_parameters fills them.
        self.materialized = not any(p.is_meta for p in params)
        with torch.no_grad():
            # Autograd leaf first; _unsharded_data aliases its storage (see the module note).
            self.unsharded = torch.empty(self.layout.padded_numel, dtype=config.param_dtype,
                                         device=config.device)
            self._unsharded_data = self.unsharded.data
            if config.shards_in_place and not config.comm.in_place_ok:
                raise ValueError(f"{describe(config.comm)} needs the shard apart from the full "
                                 f"buffer, but stage {config.stage.number} without a cast keeps "
                                 "it inside: use stage 3, or compute in another dtype (mp_policy)")
            if config.shards_in_place:
                # (.data: its own version counter, which only writes to the shard move.)
                self.sharded = self._unsharded_data[self.local.slot].data
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
        # forms that decide what their parameter sends (FSDP2's all-gather extension)
        self._sending = {sp.index: cast(api.SendingForm, sp.form)
                         for sp in self.sharded_params if sp.form.sends}
        self.post_backward_handle = None  # the post-accumulate-grad hook on ``unsharded``
        self.grads = Gradient(self.unsharded, self.sharded_params, self.local, self.sharded,
                              config, mesh, self.name, controls)
        self.sharded_state = ShardedState.UNSHARDED
        self._gathering: AllGather | None = None  # GATHERING: the all-gather in flight
        self._post_forward_shard: torch.Tensor | None = None  # SHARDED_POST_FORWARD (hpZ)
        # In-place writes to a DTensor parameter (rows) bump its own version counter, not the
        # shard's: watch both (flat and whole parameters are views sharing the shard's).
        self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]
        self._seen_version = self._versions()  # what the full parameters were made from
        self.stepped = False  # an optimizer with a parameter of this unit stepped since
        if config.stage.frees_parameters:
            self._free()

    def place_under(self, parent: "Unit", sibling: bool = False) -> None:
        """``parent`` is the unit above this one (``zero.shard``, bottom-up); a sibling, the
        frozen part of the same modules, follows ``parent``'s settings."""
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
        """Parameters a client put in the module after sharding (``load_state_dict(sd,
        assign=True)``: torchtune, accelerate; ``setattr``: transformers; a tie, HF's
        ``tie_weights()``): adopted as FSDP2's ``reset_sharded_param`` does, or refused by
        name (``zero/core/adoption.py``)."""
        if self.iteration.state is not TrainingState.IDLE:
            return  # (views are in the slots while the unit computes)
        if adoption.adopt_replaced(self):
            self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]
            # Sharded from meta and every parameter now replaced (transformers' loading):
            # the shard holds values.
            self.materialized = self.materialized or not any(p.is_meta for p in self.params)

    def params_on_meta(self) -> None:
        """Show the sharded parameters on the meta device, as FSDP2 does for a module it
        sharded there: clients ask "is anything still on meta?" before they call ``to_empty``
        and ``reset_parameters`` (Lightning). The shard itself is real from the start; the
        parameters point at it again in ``params_on_shard``."""
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
        """The parameters shown on meta (``params_on_meta``) become views of this rank's
        pieces of the shard again, each the same Python object (``torch.utils.swap_tensors``,
        as ``nn.Module.to_empty`` keeps a DTensor's identity), so writes through them (the
        model's own init) land in the shard."""
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
        """The process group the unit is sharded over (None: the world)."""
        return self.mesh.group

    @property
    def all_group(self):
        """Every rank training (HSDP's whole mesh): the group the ranks agree in."""
        return self.mesh.all_group

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def replicated(self) -> bool:
        """HSDP: the reduced gradient shard is averaged over replicas of the sharded model."""
        return self.mesh.replicated

    @property
    def stage(self) -> int:
        return self.config.stage.number

    @property
    def offload(self) -> api.OffloadPolicy:
        return self.config.offload

    @property
    def frees_parameters(self) -> bool:
        """Stage 3: the full parameters are freed between uses."""
        return self.config.stage.frees_parameters

    def set_reshard_after_forward(self, reshard: bool | None) -> bool:
        """Stage 3's setting (None: by the unit's role); False where the stage keeps the full
        parameters whatever is asked (stages 1 and 2), and then nothing is set."""
        if self.config.stage.keep_params:
            return False
        self.controls.reshard_after_forward = reshard
        return True

    def use_comm(self, change: Callable[[api.CommPolicy], api.CommPolicy]) -> None:
        """Collectives of another comm policy from now on: ``change(policy)`` makes it from
        the present one (FSDP2's ``set_custom_all_gather`` and relatives). The config stays
        frozen: the unit and its gradient take a new one."""
        self.config = dataclasses.replace(self.config, comm=change(self.config.comm))
        self.grads.use_config(self.config)

    def rename(self, name: str) -> None:
        self.name = self.grads.name = name

    def piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's piece of a shard-sized buffer (empty if this rank holds none of it)."""
        return self.local.piece(shard, i)

    def exposed_piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """The same piece shown as parameter i is shown (``layout.exposed``): 1-D (flat), a
        DTensor (rows), the whole shape on its owner (whole)."""
        return self.layout.exposed(self.local.piece(shard, i), i, self.mesh.rank,
                                   self.mesh.placement)

    def attach(self, root) -> None:
        """Belong to ``root`` (``Root.take``: the root's ``zero.shard`` takes this unit over)."""
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
        """Identifies the full buffer's storage; it survives ``resize_`` (free and re-gather)."""
        return self._unsharded_data.untyped_storage()._cdata

    # ---- parameters: unshard (all-gather) and reshard (free) -------------------------------

    def _versions(self) -> tuple[int, ...]:
        return (self.sharded._version, *(p._version for p in self._wrapped))

    def _gather(self, phase: str) -> None:
        """Start an all-gather into the (allocated) full buffer: GATHERING. On an accelerator
        the copy into the wire (a cast, a host-to-device copy) runs on the context's copy-in
        stream and the collective on its all-gather stream, beside the computation
        (``zero/comm/context.py``'s note on streams); ``wait_unshard`` joins them."""
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
            # The values forward computed with, already gathered once (qwZ: dequantized):
            # moved exactly, so that backward computes with forward's weights; slices of
            # the buffer the parameters view, whatever the layout's wire order.
            comm, copies, sending = EXACT, False, {}
        else:  # (host -> device, in the master dtype, under CPU offload)
            with streams.use(streams.copy_in):
                source = self.config.offload.to_device(self.sharded, self.unsharded.device,
                                                       self.name, phase)
            group, slot, sending = self.mesh.group, self.local.slot, self._sending
        target = self._unsharded_data
        if copies:  # gathered rank-major, copied out where the parameters are
            target = self._unsharded_data.new_empty(self.layout.padded_numel)  # (computing
            # stream's memory, as every buffer here: only it frees, after it has waited)
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
        """Make the full parameters readable: all-gather them, or wait for the gather in flight.

        With ``async_op`` the gather is only started (a prefetch); ``wait_unshard`` ends it.
        """
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
        """Start gathering ahead of need (the root asks, as its schedule or the user's lists
        say): only a unit that frees its parameters has anything to gather, and in backward
        only one whose backward reads them (FSDP2's ``_prefetch_unshard``)."""
        if not self.config.stage.frees_parameters or (
                phase == "backward" and not self.controls.unshard_in_backward):
            return
        with label(f"{phase}_prefetch for {self.name}"):
            self.unshard(phase=phase, async_op=True)

    def wait_unshard(self) -> None:
        """The gather in flight has ended: the computing stream waits for its streams' work
        (the collective itself by ``wait()``), and what it read and wrote may go."""
        if self.sharded_state is ShardedState.GATHERING:
            gathering, self._gathering = self._gathering, None
            assert gathering is not None  # (GATHERING: a gather is in flight)
            with label("all_gather_copy_out", self.name):  # (FSDP2's name: wait, copy out)
                self.root.context.streams(self.unsharded.device).wait(gathering.event)
                finish(gathering.work)
            self.sharded_state = ShardedState.UNSHARDED

    def shard_written(self) -> bool:
        """Whether the shard changed since the full parameters were last gathered from it:
        ``opt.step()``, an in-place edit (``p.mul_(0.5)``), a checkpoint load. Its version
        counter tells, whoever wrote it (but not a write through ``p.data``); and an
        optimizer step marks it (``stepped``) on a rank that holds none of its elements too."""
        return self.stepped or self._versions() != self._seen_version

    def mark_stepped(self) -> None:
        """An optimizer stepped this unit's parameters (``zero/surface/attach.py``), on this rank
        whether or not it holds any of their elements: the next forward refreshes it."""
        if self.unsharded.requires_grad:  # (frozen units are never stepped)
            self.stepped = True

    def reshard(self, after_forward: bool = False) -> None:
        """Stage 3: give the full parameters' memory back; stages 1/2 keep them (and so does a
        unit pinned by ``zero.unshard``). After a forward that backward will follow, a unit
        with a ``post_forward`` mesh (hpZ) keeps this rank's slice of the parameters over
        that smaller group, for backward's all-gather within it (SHARDED_POST_FORWARD)."""
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
        """hpZ: the post-forward shard will not be used (no backward came, or the shard
        changed)."""
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            self._post_forward_shard, self.sharded_state = None, ShardedState.SHARDED

    def shard_changed(self, phase: str = "step") -> None:
        """The shard holds new values: refresh (stages 1/2, async until the unit's forward)
        or drop (stage 3) the full parameters. The root's next forward calls this for every
        unit whose shard was written (``shard_written``); whoever writes ``sharded`` must
        first call ``wait_unshard()`` (a stage 1/2 gather may still be reading it)."""
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
        """Backward is done with the parameters: give the module its sharded ones back, and
        (stage 3) free the full ones, unless ``set_reshard_after_backward(False)``."""
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
