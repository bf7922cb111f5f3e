"""A unit: one module whose own parameters are sharded together as one flat parameter.

ZeRO stages 1, 2 and 3 are one mechanism here; the stage only decides *when* things happen
(``zero/stage.py``: the whole difference is a table of two booleans). The whole algorithm
is a symmetry: the all-gather that assembles a unit's parameters for its forward is
mirrored by the reduce-scatter that splits its gradient in backward (SimpleFSDP's summary
of FSDP).

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
``zero/guard.py`` raises if backward ever reaches them while it is empty.

When each of these things happens, and in which ``State`` a unit is meanwhile, is
``zero/hooks.py``: the life of a unit in one iteration. The views the module computes with
are made once per iteration, so two forwards before one backward accumulate their gradients
in the order DDP does.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zero import comm, hooks, refuse
from zero.flat import FlatLayout
from zero.grads import GradientMixin
from zero.hooks import State
from zero.root import Root


class Unit(GradientMixin):
    """The sharded state and the hooks of one ``zero.shard``-ed module (see the module note)."""

    def __init__(self, modules, params, locations, stage, group, mp_policy, reshard_after_forward,
                 device, replicate_group=None, secondary_group=None, all_group=None):
        self.modules = modules  # usually one; zero.shard([a, b]) makes one unit of several
        self.module = modules[0]
        self.name = "+".join(type(m).__name__ for m in modules)  # the root renames by path
        self.stage = stage
        self.group = group  # the ranks that shard this unit among themselves
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # Hybrid sharding (notes/14): HSDP averages the reduced shard over the replicas; hpZ
        # keeps a secondary shard over a node after forward and gathers from it in backward.
        self.replicate_group, self.secondary_group = replicate_group, secondary_group
        self.all_group = all_group if all_group is not None else group  # every rank training
        self._secondary: torch.Tensor | None = None
        self.locations = locations  # per parameter: the (module, attribute) pairs that use it
        self.layout = FlatLayout([p.shape for p in params], self.world_size)
        dtype = params[0].dtype if params else torch.float32
        self.param_dtype = (mp_policy and mp_policy.param_dtype) or dtype
        self.reduce_dtype = (mp_policy and mp_policy.reduce_dtype) or self.param_dtype
        self.cast_inputs = mp_policy is not None and mp_policy.param_dtype is not None
        self._reshard_after_forward = reshard_after_forward
        self.requires_grad_sync = True
        self.parent: Unit | None = None
        self.sibling_of: Unit | None = None  # the unit made from the same modules (frozen part)
        self._root: Root | None = None  # the root's duties, if this unit is the root
        self._pieces = {p.param_index: p for p in self.layout.pieces(self.rank)}
        shard = self.layout.shard(self.rank)
        self._slot = slice(shard.offset, shard.offset + shard.size)
        self.state = State.IDLE

        # A module built on the meta device has no values yet: zero.init_parameters fills them.
        self.materialized = not any(p.is_meta for p in params)
        with torch.no_grad():
            # Autograd leaf first; _unsharded_data aliases its storage (see the module note).
            self.unsharded = torch.empty(self.layout.padded_numel, dtype=self.param_dtype,
                                         device=device)
            self._unsharded_data = self.unsharded.data
            self._shard_in_place = stage.keep_params and self.param_dtype == dtype
            if self._shard_in_place:
                # Stages 1/2 without a cast: the shard lives inside the full buffer, so the
                # all-gather after each step happens in place and params cost Ψ, not Ψ + Ψ/N.
                # (.data: its own version counter, which only writes to the shard move.)
                self.sharded = self._unsharded_data[self._slot].data
            else:
                self.sharded = torch.empty(self.layout.shard_numel, dtype=dtype, device=device)
            self.sharded.zero_()  # the padding stays zero
            if self.materialized:
                for i, piece in self._pieces.items():  # only our pieces: no full copy
                    flat = params[i].detach().reshape(-1)
                    self._piece(self.sharded, i).copy_(flat[piece.param_offset :][: piece.length])
        self.unsharded.requires_grad_(any(p.requires_grad for p in params))
        self.params = [self._sharded_param(i, p) for i, p in enumerate(params)]
        self._views: list[torch.Tensor] | None = None  # this iteration's views into unsharded
        self._views_for: tuple[bool, ...] = ()  # which params required grad when they were made
        self._post_backward_hook = None
        self.forward_calls = 0  # forwards this iteration
        self.inputs_done = False  # backward has computed the gradients of the unit's inputs
        self.backward_task = -1  # the autograd graph task that reached the unit's outputs
        self.reshard_after_backward = True  # False: keep gathered for the next micro-batch
        self.pinned = False  # zero.unshard(module): gathered until zero.reshard(module)
        self.forward_prefetch: list[Unit] | None = None  # explicit lists (zero/controls.py);
        self.backward_prefetch: list[Unit] | None = None  # None: the root's implicit order
        self._pending: Any = None  # an all-gather in flight
        self.is_unsharded = stage.keep_params
        self._seen_version = self.sharded._version  # what the full parameters were made from
        self.broadcast_buffers = False
        self.init_gradients()
        if not stage.keep_params:
            self._free_unsharded()

    def _piece(self, flat_shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's piece of a shard-sized buffer (empty if this rank holds none of it)."""
        piece = self._pieces.get(i)
        return flat_shard[piece.shard_offset :][: piece.length] if piece else flat_shard[:0]

    def _sharded_param(self, i: int, orig: nn.Parameter) -> nn.Parameter:
        p = nn.Parameter(self._piece(self.sharded, i), requires_grad=orig.requires_grad)
        p._zero_unit, p._zero_index = self, i
        return p

    # ---- parameters: unshard (all-gather) and reshard (free) -------------------------------

    def _gather(self, phase: str, async_op: bool = False) -> None:
        self._seen_version = self.sharded._version  # the full parameters will show this shard
        if self.layout.padded_numel == 0:
            return
        if self._secondary is not None:  # hpZ: gather from the node's secondary shards
            group, slot = self.secondary_group, self._unsharded_data[self._secondary_slot()]
            slot.copy_(self._secondary)
            self._secondary = None
        else:
            group, slot = self.group, self._unsharded_data[self._slot]
            if not self._shard_in_place:
                slot.copy_(self.sharded)  # cast the fp32 shard to param_dtype once, before
        # (N*S,) <- (S,) per rank; in place: our slot of the output is the input
        work = comm.all_gather(self._unsharded_data, slot, group=group, unit=self.name,
                               phase=phase, async_op=async_op)
        self._pending = work

    def _secondary_slot(self) -> slice:
        """hpZ: this rank's slice of the full flat parameter among its node's ranks."""
        n = dist.get_world_size(self.secondary_group)
        size = self.layout.padded_numel // n
        start = dist.get_rank(self.secondary_group) * size
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
            self._gather(phase, async_op=True)
            self.is_unsharded = True
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def shard_written(self) -> bool:
        """Whether the shard changed since the full parameters were last gathered from it:
        ``opt.step()``, an in-place edit (``p.mul_(0.5)``), a checkpoint load. Its version
        counter tells, whoever wrote it (but not a write through ``p.data``)."""
        return self.sharded._version != self._seen_version

    def reshard(self, keep_secondary: bool = False) -> None:
        """Stage 3: give the full parameters' memory back; stages 1/2 keep them (and so does a
        unit pinned by ``zero.unshard``). hpZ, after a forward that backward will follow:
        keep this rank's secondary shard, for an all-gather within the node."""
        if self.stage.keep_params or self.pinned or not self.is_unsharded:
            return
        self.wait_unshard()
        if keep_secondary and self.secondary_group is not None:
            self._secondary = self._unsharded_data[self._secondary_slot()].clone()
        self._free_unsharded()

    def _free_unsharded(self) -> None:
        self._unsharded_data.untyped_storage().resize_(0)
        self.is_unsharded = False

    def shard_changed(self, phase: str = "step") -> None:
        """The shard holds new values: refresh (stages 1/2, async until the unit's forward)
        or drop (stage 3) the full parameters. The root's next forward calls this for every
        unit whose shard was written (``shard_written``); whoever writes ``sharded`` must
        first call ``wait_unshard()`` (a stage 1/2 gather may still be reading it)."""
        self.materialized = True
        self._secondary = None  # made from the old values
        if self.stage.keep_params or (self.pinned and self.is_unsharded):
            self.wait_unshard()
            self._gather(phase=phase, async_op=True)
        else:
            self.reshard()

    # ---- which tensors the module computes with --------------------------------------------

    def use(self, tensors: list[torch.Tensor]) -> None:
        """Put ``tensors`` (one per parameter) wherever the module uses the parameters."""
        for t, locs in zip(tensors, self.locations):
            for mod, attr in locs:
                mod._parameters[attr] = t  # a plain tensor: autograd reaches the flat leaf

    def use_unsharded_views(self) -> None:
        """Compute with views into ``unsharded``, made once per iteration (module note)."""
        wants = tuple(p.requires_grad for p in self.params)
        if self._views is None or self._views_for != wants:  # new iteration, or (un)frozen
            self._views, self._views_for = self._make_views(wants), wants
        self.use(self._views)

    def _make_views(self, wants: tuple[bool, ...]) -> list[torch.Tensor]:
        if self.unsharded.requires_grad != any(wants):  # a parameter was (un)frozen
            self.unsharded.requires_grad_(any(wants))
        if any(wants) and self._post_backward_hook is None:
            self._post_backward_hook = self.unsharded.register_post_accumulate_grad_hook(
                partial(hooks.post_backward, self))
        views = []
        # Even under no_grad or inference_mode (an eval forward, reentrant checkpointing's
        # first pass) the views must lead to the leaf: a later forward may reuse them.
        with torch.inference_mode(False), torch.enable_grad():
            for i, v in enumerate(self.layout.views(self.unsharded)):
                if not wants[i]:
                    v = v.detach()  # frozen: no gradient is computed for it
                elif v.requires_grad:
                    v.register_hook(partial(self._mark_used, i))
                views.append(v)
        return views

    def use_sharded_params(self, after_forward: bool = False) -> None:
        if after_forward:
            refuse.replaced_in_forward(self)
        self.use(self.params)

    def __deepcopy__(self, memo):
        refuse.deepcopy(self)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point forward input, in the compute dtype (mixed precision)."""
        return t.to(self.param_dtype) if t.is_floating_point() else t

    def end_iteration(self) -> None:
        """Back to IDLE: sharded parameters in the module; stage 3 frees the full ones."""
        self.use_sharded_params()
        self.state = State.IDLE
        if self.reshard_after_backward:
            self.reshard()
        self._secondary = None  # (hpZ: a forward whose backward never came)
        self._views = None  # the next iteration makes new ones
        self.forward_calls, self.inputs_done, self.backward_task = 0, False, -1

    @property
    def reshard_after_forward(self) -> bool:
        if self.stage.keep_params:
            return False
        if self.sibling_of is not None and self._reshard_after_forward is None:
            return self.sibling_of.reshard_after_forward
        if self._reshard_after_forward is None:
            return self.parent is not None  # FSDP2: the root keeps its parameters for backward
        return self._reshard_after_forward

    @property
    def root(self) -> Root:
        top = self
        while top.parent is not None:
            top = top.parent
        if top._root is None:
            top._root = Root(top)
        return top._root
