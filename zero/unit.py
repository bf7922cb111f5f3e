"""A unit: one module whose own parameters are sharded together as one flat parameter.

ZeRO stages 1, 2 and 3 are one mechanism here; the stage only decides *when* things happen
(``zero/stage.py``: the whole difference is a table of two booleans). The whole algorithm is a symmetry: the all-gather that assembles a unit's
parameters for its forward is mirrored by the reduce-scatter that splits its gradient in
backward (SimpleFSDP's summary of FSDP).

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
in the autograd graph stay valid because the same storage is refilled before backward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map_only

from zero import comm
from zero.flat import FlatLayout
from zero.root import Root


def in_backward() -> bool:
    """True while autograd's engine runs a backward (e.g. activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """The sharded state and the hooks of one ``zero.shard``-ed module (see the module note)."""

    def __init__(self, module, params, locations, stage, group, mp_policy, reshard_after_forward,
                 device):
        self.module = module
        self.name = type(module).__name__  # the root renames its units by their paths
        self.stage = stage
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.locations = locations  # per parameter: the (module, attribute) pairs that use it
        self.layout = FlatLayout([p.shape for p in params], self.world_size)
        dtype = params[0].dtype if params else torch.float32
        self.param_dtype = (mp_policy and mp_policy.param_dtype) or dtype
        self.reduce_dtype = (mp_policy and mp_policy.reduce_dtype) or self.param_dtype
        self.cast_inputs = mp_policy is not None and mp_policy.param_dtype is not None
        self._reshard_after_forward = reshard_after_forward
        self.requires_grad_sync = True
        self.parent: Unit | None = None
        self._root: Root | None = None  # the root's duties, if this unit is the root
        self._pieces = {p.param_index: p for p in self.layout.pieces(self.rank)}
        shard = self.layout.shard(self.rank)
        self._slot = slice(shard.offset, shard.offset + shard.size)

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
                self.sharded = self._unsharded_data[self._slot]
            else:
                self.sharded = torch.empty(self.layout.shard_numel, dtype=dtype, device=device)
            self.sharded.zero_()  # the padding stays zero
            if self.materialized:
                for i, piece in self._pieces.items():  # only our pieces: no full copy
                    flat = params[i].detach().reshape(-1)
                    self._piece(self.sharded, i).copy_(flat[piece.param_offset :][: piece.length])
        self.unsharded.requires_grad_(any(p.requires_grad for p in params))
        self.params = [self._sharded_param(i, p) for i, p in enumerate(params)]
        self._used = [False] * len(params)  # got a gradient since the last reduction
        self._views: list[torch.Tensor] | None = None
        self._grad_shard: torch.Tensor | None = None  # reduced, not yet handed to params
        self._pending: Any = None  # an all-gather in flight
        self._reduction: Any = None  # a reduce-scatter in flight: (work, full grad, shard)
        self.is_unsharded = stage.keep_params
        self.in_backward = False
        if not stage.keep_params:
            self._free_unsharded()
        elif self.materialized:
            self._gather(phase="init")  # every rank starts from the same full parameters

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
        if self.layout.padded_numel == 0:
            return
        slot = self._unsharded_data[self._slot]
        if not self._shard_in_place:
            slot.copy_(self.sharded)  # cast the fp32 shard to param_dtype once, before the gather
        # (N*S,) <- (S,) per rank; in place: our slot of the output is the input
        work = comm.all_gather(self._unsharded_data, slot, group=self.group, unit=self.name,
                               phase=phase, async_op=async_op)
        self._pending = work

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

    def reshard(self) -> None:
        """Stage 3: give the full parameters' memory back; stages 1/2 keep them."""
        if self.stage.keep_params or not self.is_unsharded:
            return
        self.wait_unshard()
        self._free_unsharded()

    def _free_unsharded(self) -> None:
        self._unsharded_data.untyped_storage().resize_(0)
        self._views = None
        self.is_unsharded = False

    def shard_changed(self, phase: str = "step") -> None:
        """The shard now holds new values: refresh (stages 1/2, async until the next forward)
        or drop (stage 3) the full parameters. Whoever writes ``sharded`` must first call
        ``wait_unshard()`` (a stage 1/2 gather may still be reading it), then this."""
        self.materialized = True
        if self.stage.keep_params:
            self.wait_unshard()
            self._gather(phase=phase, async_op=True)
        else:
            self.reshard()

    # ---- which tensors the module computes with --------------------------------------------

    def use_unsharded_views(self, fresh: bool) -> None:
        if fresh or self._views is None:
            self._views = []
            for i, (v, p) in enumerate(zip(self.layout.views(self.unsharded), self.params)):
                if not p.requires_grad:
                    v = v.detach()  # frozen: no gradient is computed for it
                elif v.requires_grad:
                    v.register_hook(partial(self._mark_used, i))
                self._views.append(v)
        for v, locs in zip(self._views, self.locations):
            for mod, attr in locs:
                mod._parameters[attr] = v  # a plain tensor: autograd reaches the flat leaf

    def use_sharded_params(self) -> None:
        for p, locs in zip(self.params, self.locations):
            for mod, attr in locs:
                mod._parameters[attr] = p

    def _mark_used(self, i: int, grad: torch.Tensor) -> None:
        self._used[i] = True

    # ---- gradients: reduce-scatter, then hand the shard to the parameters -------------------

    def reduce_grad(self) -> None:
        """Start reducing: (N*S,) full flat gradient -> (S,) this rank's shard of the mean.

        Asynchronous: backward goes on while it runs; ``wait_reduce`` ends it.
        """
        grad, self.unsharded.grad = self.unsharded.grad, None  # the unit lets go of it
        if grad is None:
            return
        grad = grad.to(self.reduce_dtype)  # FSDP2's reduce_dtype: upcast before reducing
        shard = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        work = comm.reduce_scatter(shard, grad, op="avg", group=self.group, unit=self.name,
                                   phase="backward", async_op=True)
        self._reduction = (work, grad, shard)  # grad stays alive until the collective is done

    def wait_reduce(self) -> None:
        if self._reduction is None:
            return
        work, _, shard = self._reduction
        work.wait()
        self._reduction = None  # the full gradient is freed here
        self._grad_shard = shard  # one reduction per backward; assign_grads hands it out

    def assign_grads(self, used: list[bool]) -> None:
        """Give each used parameter its piece of the reduced gradient (accumulating)."""
        shard, self._grad_shard = self._grad_shard, None
        self._used = [False] * len(self.params)
        if shard is None:
            return
        shard = shard.to(self.sharded.dtype)
        for i, p in enumerate(self.params):
            if not used[i]:
                continue  # unused everywhere: grad stays None, as in DDP
            g = self._piece(shard, i)
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g

    # ---- module hooks ---------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any):
        if self.cast_inputs:
            args, kwargs = tree_map_only(torch.Tensor, self._cast, (args, kwargs))
        if in_backward():  # activation-checkpoint recompute: already unsharded for backward
            self.unshard(phase="backward")
        else:
            self.unshard(phase="forward", async_op=True)
            self.root.forward_started(self)  # records the order; prefetches the next unit
            self.wait_unshard()
        # Fresh views on every forward, recomputations included: views made under no_grad
        # (reentrant checkpointing's first pass) cannot carry gradients to the flat leaf.
        self.use_unsharded_views(fresh=True)
        return args, kwargs

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.param_dtype) if t.is_floating_point() else t

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return output  # activation-checkpoint recompute: backward still needs everything
        self.use_sharded_params()
        if not torch.is_grad_enabled():
            self.reshard()  # no backward will come for this forward
            return output
        if self.reshard_after_forward:
            self.reshard()
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self.pre_backward)
        return output

    def pre_backward(self, grad: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.unshard(phase="backward", async_op=True)
            self.root.backward_started(self)  # prefetches the unit before this one
            self.wait_unshard()
            self.use_unsharded_views(fresh=False)

    def post_backward(self, leaf: torch.Tensor) -> None:
        """The unit's flat gradient is complete (post-accumulate-grad hook on ``unsharded``)."""
        self.root.queue_final_callback()
        if self.stage.reduce_each_unit and self.requires_grad_sync:
            self.root.reduce(self)
        # A frozen parameter's data may still be needed for an input gradient after this
        # hook (it feeds no gradient into the leaf), so such units reshard in the callback.
        if all(p.requires_grad for p in self.params):
            self.use_sharded_params()
            self.in_backward = False
            self.reshard()

    @property
    def reshard_after_forward(self) -> bool:
        if self.stage.keep_params:
            return False
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
