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

What the unit holds of its parameters is one ``ShardedState`` (``zero/core/state.py``), moved
only by ``unshard``, ``wait_unshard``, ``reshard`` and ``shard_changed`` below; its gradient is
one ``Gradient`` (``zero/core/grads.py``), ``unit.grads``. When each of these things happens
is ``zero/core/hooks.py`` (the life of a unit in one iteration) and ``zero/core/schedule.py``
(prefetching, the order of reductions). ``held()`` tells an observer what the unit holds.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero.comm import backend
from zero.comm.flat_collectives import DEFAULT as DEFAULT_COLLECTIVES
from zero.core import checks, registry
from zero.core.flat import FlatLayout
from zero.core.grads import Gradient
from zero.core.rows import CopiedOut
from zero.core.state import Held, ShardedState, TrainingState


class Unit:
    """The sharded state of one ``zero.shard``-ed module (see the module note).

    Args:
        modules: the modules sharded together (usually one).
        params, locations: the unit's parameters, and per parameter every (module,
            attribute) that uses it.
        stage: a ``Stage``; group: the ranks that shard the unit; mp_policy: a
            ``MixedPrecision`` or None; reshard_after_forward: stage 3's setting (None:
            decided by whether the unit is the root); device: where the shards live.
        replicate_group, secondary_group, all_group: HSDP's replicas, hpZ's node, and the
            group of every rank training (notes/14).
        comm: how the unit's flat buffers cross the ranks (``zero/comm/flat_collectives.py``).
        layout: which rank holds which element: a class like ``FlatLayout``
            (``zero/core/flat.py``), made from the parameters' shapes and the world size.
        mesh: the ``DeviceMesh`` the user gave, if any (1-D: ``group``'s; 2-D: HSDP's):
            DTensor parameters (layout "rows") are placed on it.
        offload: where the shards live and how they cross to the compute device
            (``zero/offload.py``), or None: on the compute device.
    """

    def __init__(self, modules, params, locations, stage, group, mp_policy, reshard_after_forward,
                 device, replicate_group=None, secondary_group=None, all_group=None,
                 comm=DEFAULT_COLLECTIVES, layout=FlatLayout, mesh=None, offload=None):
        self.modules = modules  # usually one; zero.shard([a, b]) makes one unit of several
        self.module = modules[0]
        self.name = "+".join(type(m).__name__ for m in modules)  # the root renames by path
        self.stage = stage
        self.group = group  # the ranks that shard this unit among themselves
        self.rank, self.world_size = backend.rank(group), backend.world_size(group)
        self.replicate_group, self.secondary_group = replicate_group, secondary_group
        self.all_group = all_group if all_group is not None else group  # every rank training
        self.comm, self.offload = comm, offload
        self.placement = mesh if mesh is not None else group  # where DTensors are placed
        self.locations = locations  # per parameter: the (module, attribute) pairs that use it
        self.layout = layout([p.shape for p in params], self.world_size)
        self.local = self.layout.local(self.rank)  # our slot and pieces
        dtype = params[0].dtype if params else torch.float32
        self.param_dtype = (mp_policy and mp_policy.param_dtype) or dtype
        self.reduce_dtype = (mp_policy and mp_policy.reduce_dtype) or self.param_dtype
        self.cast_inputs = (mp_policy is not None and mp_policy.param_dtype is not None
                            and getattr(mp_policy, "cast_forward_inputs", True))
        self.output_dtype = getattr(mp_policy, "output_dtype", None)
        self.reshard_after_forward_setting = reshard_after_forward  # stage 3; None: by role
        self.requires_grad_sync = True
        self.parent: Unit | None = None
        self.sibling_of: Unit | None = None  # the unit made from the same modules (frozen part)
        self.root_state = None  # the root's duties, if this unit is the root (zero/core/root.py)
        self.state = TrainingState.IDLE

        # A module built on the meta device has no values yet: zero.init_parameters fills them.
        self.materialized = not any(p.is_meta for p in params)
        with torch.no_grad():
            # Autograd leaf first; _unsharded_data aliases its storage (see the module note).
            self.unsharded = torch.empty(self.layout.padded_numel, dtype=self.param_dtype,
                                         device=device)
            self._unsharded_data = self.unsharded.data
            self.shard_in_place = (stage.shards_in_place(self.param_dtype, dtype)
                                   and not self.layout.copies and offload is None)
            if self.shard_in_place and not getattr(comm, "in_place_ok", True):
                raise ValueError(f"{comm!r} needs the shard apart from the full buffer, but "
                                 f"stage {stage.number} without a cast keeps it inside: use "
                                 "stage 3, or compute in another dtype (mp_policy)")
            if self.shard_in_place:
                # (.data: its own version counter, which only writes to the shard move.)
                self.sharded = self._unsharded_data[self.local.slot].data
            else:
                home = offload.home(device) if offload is not None else device
                pin = offload is not None and offload.pinned(torch.device(device))
                self.sharded = torch.empty(self.layout.shard_numel, dtype=dtype, device=home,
                                           pin_memory=pin)
            self.sharded.zero_()  # the padding stays zero
            if self.materialized:
                for i, piece in self.local.pieces.items():  # only our pieces: no full copy
                    flat = params[i].detach().reshape(-1)
                    self.local.piece(self.sharded, i).copy_(flat[piece.param_offset :][: piece.length])
        self.unsharded.requires_grad_(any(p.requires_grad for p in params))
        self.params = [self._sharded_param(i, p) for i, p in enumerate(params)]
        self.views: list[torch.Tensor] | None = None  # this iteration's views (zero/core/hooks.py)
        self.views_for: tuple[bool, ...] = ()  # which params required grad when they were made
        self.post_backward_handle = None  # the post-accumulate-grad hook on ``unsharded``
        self.forward_calls = 0  # forwards this iteration
        self.inputs_done = False  # backward has computed the gradients of the unit's inputs
        self.backward_task = -1  # the autograd graph task that reached the unit's outputs
        self.reshard_after_backward = True  # False: keep gathered for the next micro-batch
        self.pinned = False  # zero.unshard(module): gathered until zero.reshard(module)
        self.forward_prefetch: list[Unit] | None = None  # explicit lists (zero/controls.py);
        self.backward_prefetch: list[Unit] | None = None  # None: the schedule's implicit order
        self.broadcast_buffers = False
        self.grads = Gradient(self.unsharded, self.params, self.local, self.sharded,
                              self.reduce_dtype,
                              stage.keeps_full_gradient(self.param_dtype, self.reduce_dtype, dtype),
                              group, replicate_group, comm, self.name, self.placement, offload)
        self.sharded_state = ShardedState.UNSHARDED
        self._gather_work = None  # GATHERING: the all-gather in flight
        self._secondary: torch.Tensor | None = None  # SECONDARY: hpZ's secondary shard
        # In-place writes to a DTensor parameter (rows) bump its own version counter, not the
        # shard's: watch both (flat and whole parameters are views sharing the shard's).
        self._wrapped = [p for p in self.params if type(p.data) is not torch.Tensor]
        self._seen_version = self._versions()  # what the full parameters were made from
        self.stepped = False  # an optimizer with a parameter of this unit stepped since
        if stage.frees_parameters:
            self._free()

    def _sharded_param(self, i: int, orig: nn.Parameter) -> nn.Parameter:
        p = nn.Parameter(self.exposed_piece(self.sharded, i), requires_grad=orig.requires_grad)
        registry.mark_piece(p, self, i)
        return p

    def rename(self, name: str) -> None:
        self.name = self.grads.name = name

    def piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's piece of a shard-sized buffer (empty if this rank holds none of it)."""
        return self.local.piece(shard, i)

    def exposed_piece(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """The same piece shown as parameter i is shown (``layout.exposed``): 1-D (flat), a
        DTensor (rows), the whole shape on its owner (whole)."""
        return self.layout.exposed(self.local.piece(shard, i), i, self.rank, self.placement)

    @property
    def keeps_full_gradient(self) -> bool:
        return self.grads.keeps_full

    @property
    def is_unsharded(self) -> bool:
        """The full buffer is allocated (readable once ``wait_unshard`` returns)."""
        return self.sharded_state in (ShardedState.GATHERING, ShardedState.UNSHARDED)

    def held(self) -> Held:
        """What this unit holds now, for observers (trackers, traces): see ``Held``."""
        g = self.grads
        return Held(self.sharded_state, self.state, self.sharded, self.unsharded, self._secondary,
                    self.unsharded.grad, g.reduction.grad if g.reduction else None, g.reduced,
                    g.unsynced)

    def storage_key(self) -> int:
        """Identifies the full buffer's storage; it survives ``resize_`` (free and re-gather)."""
        return self._unsharded_data.untyped_storage()._cdata

    # ---- parameters: unshard (all-gather) and reshard (free) -------------------------------

    def _versions(self) -> tuple[int, ...]:
        return (self.sharded._version, *(p._version for p in self._wrapped))

    def _gather(self, phase: str) -> None:
        """Start an all-gather into the (allocated) full buffer: GATHERING."""
        self._seen_version = self._versions()  # the full parameters will show this shard
        self.stepped = False
        if self.layout.padded_numel == 0:
            self.sharded_state = ShardedState.UNSHARDED
            return
        if self.sharded_state is ShardedState.SECONDARY:  # hpZ: from the node's secondary shards
            source, group, slot = self._secondary, self.secondary_group, self._secondary_slot()
            self._secondary = None
        else:
            source, group, slot = self.sharded, self.group, self.local.slot
            if self.offload is not None:  # host -> device, in the master dtype
                source = self.offload.to_device(source, self.unsharded.device, self.name, phase)
        target = self._unsharded_data
        if self.layout.copies:  # gathered rank-major, copied out where the parameters are
            target = self._unsharded_data.new_empty(self.layout.padded_numel)
        # (hpZ is stage 3, where the shard is never inside the full buffer)
        work = self.comm.all_gather(target, source, slot, in_place=self.shard_in_place,
                                    group=group, unit=self.name, phase=phase)
        if self.layout.copies:
            work = CopiedOut(work, self.layout, target, self._unsharded_data)
        self._gather_work = work
        self.sharded_state = ShardedState.GATHERING

    def _secondary_slot(self) -> slice:
        """hpZ: this rank's slice of the full flat parameter among its node's ranks."""
        n = backend.world_size(self.secondary_group)
        size = self.layout.padded_numel // n
        start = backend.rank(self.secondary_group) * size
        return slice(start, start + size)

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

    def wait_unshard(self) -> None:
        if self.sharded_state is ShardedState.GATHERING:
            self._gather_work.wait()
            self._gather_work = None
            self.sharded_state = ShardedState.UNSHARDED

    def shard_written(self) -> bool:
        """Whether the shard changed since the full parameters were last gathered from it:
        ``opt.step()``, an in-place edit (``p.mul_(0.5)``), a checkpoint load. Its version
        counter tells, whoever wrote it (but not a write through ``p.data``); and an
        optimizer step marks it (``stepped``) on a rank that holds none of its elements too."""
        return self.stepped or self._versions() != self._seen_version

    def reshard(self, keep_secondary: bool = False) -> None:
        """Stage 3: give the full parameters' memory back; stages 1/2 keep them (and so does a
        unit pinned by ``zero.unshard``). hpZ, after a forward that backward will follow:
        keep this rank's secondary shard, for an all-gather within the node."""
        if self.stage.keep_params or self.pinned or not self.is_unsharded:
            return
        self.wait_unshard()
        secondary = None
        if keep_secondary and self.secondary_group is not None:
            secondary = self._unsharded_data[self._secondary_slot()].clone()
        self._free()
        if secondary is not None:
            self._secondary, self.sharded_state = secondary, ShardedState.SECONDARY

    def _free(self) -> None:
        self._unsharded_data.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED

    def drop_secondary(self) -> None:
        """hpZ: the secondary shard will not be used (no backward came, or the shard changed)."""
        if self.sharded_state is ShardedState.SECONDARY:
            self._secondary, self.sharded_state = None, ShardedState.SHARDED

    def shard_changed(self, phase: str = "step") -> None:
        """The shard holds new values: refresh (stages 1/2, async until the unit's forward)
        or drop (stage 3) the full parameters. The root's next forward calls this for every
        unit whose shard was written (``shard_written``); whoever writes ``sharded`` must
        first call ``wait_unshard()`` (a stage 1/2 gather may still be reading it)."""
        self.materialized = True
        self.stepped = False
        self.drop_secondary()  # made from the old values
        if self.stage.keep_params or (self.pinned and self.is_unsharded):
            self.wait_unshard()
            self._gather(phase=phase)
        else:
            self.reshard()

    # ---- which tensors the module computes with --------------------------------------------

    def use(self, tensors: list[torch.Tensor]) -> None:
        """Put ``tensors`` (one per parameter) wherever the module uses the parameters."""
        for t, locs in zip(tensors, self.locations):
            for mod, attr in locs:
                mod._parameters[attr] = t  # a plain tensor: autograd reaches the flat leaf

    def use_sharded_params(self) -> None:
        self.use(self.params)

    def __deepcopy__(self, memo):
        checks.deepcopy(self)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point forward input, in the compute dtype (mixed precision)."""
        return t.to(self.param_dtype) if t.is_floating_point() else t

    def cast_output(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point forward output, in ``MixedPrecision.output_dtype``."""
        return t.to(self.output_dtype) if t.is_floating_point() else t

    def release_after_backward(self) -> None:
        """Backward is done with the parameters: give the module its sharded ones back, and
        (stage 3) free the full ones, unless ``set_reshard_after_backward(False)``."""
        self.use_sharded_params()
        if self.reshard_after_backward:
            self.reshard()

    def end_iteration(self) -> None:
        """Back to IDLE: sharded parameters in the module; stage 3 frees the full ones."""
        self.use_sharded_params()
        self.state = TrainingState.IDLE
        if self.reshard_after_backward:
            self.reshard()
        self.drop_secondary()  # (hpZ: a forward whose backward never came)
        self.views = None  # the next iteration makes new ones
        self.forward_calls, self.inputs_done, self.backward_task = 0, False, -1

    @property
    def reshard_after_forward(self) -> bool:
        setting = self.reshard_after_forward_setting
        if self.sibling_of is not None and setting is None:
            return self.sibling_of.reshard_after_forward
        return self.stage.reshards_after_forward(setting, is_root=self.parent is None)
