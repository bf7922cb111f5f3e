"""``FSDPModule``'s methods over zero's units: what ``zero.fully_shard`` mixes into a module.

Each acts on the units this module's ``fully_shard`` made (``recurse``: and those below), as in
FSDP2. Every public method of torch's ``FSDPModule`` is here, grouped by concern (a later torch's
refused by name); notes/11-conformance.md, "FSDP2's surface, item by item", tests each one.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Literal, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from zero import api
from zero.core import registry
from zero.features.custom_collectives import CustomCollectives
from zero.surface import controls, meta_init
from zero.surface.fsdp2_state import FSDPStateView


def not_freed(call: str) -> None:
    """An FSDP2 call asking stage 1 or 2 to free the parameters: accepted, with a warning."""
    warnings.warn(f"{call}: stages 1 and 2 keep the parameters between forward and backward "
                  "and between steps; use stage=3 to free them", stacklevel=3)


class ZeroFSDPModule(FSDPModule):
    """FSDP2's module methods over zero's units (mixed into ``FSDP<Class>``)."""

    _orig_cls_mro_index = 3  # [FSDP<Class>, ZeroFSDPModule, FSDPModule, Class, ...]

    @property
    def _module(self) -> nn.Module:
        """This object, as the module it is (for the type checker)."""
        return cast(nn.Module, self)

    def _units(self, recurse: bool = False) -> list:
        return registry.units_of(self._module) if recurse else registry.units_on(self._module)

    # ---- gathering -------------------------------------------------------------------------

    def unshard(self, async_op: bool = False):
        """``zero.unshard``: gathered until ``reshard()``."""
        return controls.unshard(self._module, async_op=async_op)

    def reshard(self) -> None:
        controls.reshard(self._module)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Stage 3's knob (at stages 1 and 2, ``not_freed``)."""
        if not isinstance(reshard_after_forward, bool):  # (FSDP2's check: an int is for init)
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}: a group size to reshard to "
                             "is fully_shard(reshard_after_forward=<int>)'s")
        for unit in self._units(recurse):
            if not unit.set_reshard_after_forward(reshard_after_forward) and reshard_after_forward:
                not_freed(f"set_reshard_after_forward(True) at stage {unit.stage}")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Stage 3's knob (at stages 1 and 2, ``not_freed``)."""
        if reshard_after_backward and any(not u.frees_parameters
                                          for u in self._units(recurse)):
            not_freed("set_reshard_after_backward(True)")
        controls.set_reshard_after_backward(self._module, reshard_after_backward, recurse=recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward needs none of its parameters (an embedding's): not gathered for it."""
        for unit in self._units():
            unit.controls.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        controls.set_modules_to_forward_prefetch(self._module, modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        controls.set_modules_to_backward_prefetch(self._module, modules)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """zero's side streams follow the current stream, so waiting for ``event`` is enough."""
        event.wait()

    # ---- gradients -------------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """``no_sync`` without a context; under HSDP it governs the all-reduce too (FSDP2's)."""
        controls.set_requires_gradient_sync(self._module, requires_gradient_sync, recurse=recurse)
        for unit in self._units(recurse):
            unit.controls.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False sums the micro-batches without the all-reduce over the replicas, until a
        backward with it (``zero/core/grads.py``'s note on partial reductions)."""
        for unit in self._units(recurse):
            unit.controls.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce with a sum and divide by ``factor`` (FSDP2's ``divide_factors``)."""
        for unit in self._units():
            unit.controls.divide_factor = factor

    set_reduce_scatter_divide_factor = set_gradient_divide_factor  # (FSDP2's older name)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only sums on the wire; the division after (FSDP2's, for backends without AVG)."""
        for unit in self._units():
            unit.controls.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Every parameter gets a gradient (zeros where no rank used it), as FSDP2 then does."""
        for unit in self._units(recurse):
            unit.controls.reduce_unused = reduce_scatter_unused_params

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream=None) -> None:
        """``hook(shard)`` on each reduced gradient shard, after HSDP's all-reduce if any and
        before the division after the sum, on ``stream`` (default: the all-reduce stream)."""
        for unit in self._units():
            if stream is not None and unit.replicated:
                raise ValueError("set_all_reduce_hook(stream=...) with HSDP: the hook runs "
                                 "after HSDP's all-reduce, on its stream; drop stream=")
            unit.controls.all_reduce_hook = (hook, stream)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: another backward follows in the same order (1F1B): its prefetch order is kept."""
        for unit in self._units():
            unit.root.is_last_backward = is_last_backward

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: every unit back to IDLE, work in flight
        ended, gradients discarded. The root's only, as FSDP2's."""
        units = self._units()
        if not units or units[0].parent is not None:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module: the "
                               "module the last fully_shard call was given (the whole model)")
        units[0].root.reset(discard_gradients=True)

    # ---- the collectives ------------------------------------------------------------------

    def _change_collectives(self, what: str, change: Callable[..., CustomCollectives],
                            recurse: bool = False, gathers: bool = False) -> None:
        """Each unit's ``CustomCollectives`` replaced by ``change(policy, unit)``'s copy."""
        units = self._units(recurse)
        if gathers and any(sp.form.sends for u in units for sp in u.sharded_params):
            raise NotImplementedError(
                f"{what} on a module whose parameters use FSDP2's all-gather extension "
                "(fsdp_pre_all_gather): zero gathers what the subclass returns itself and does "
                "not pass it through a comm object; use one or the other, or FSDP2's "
                "fully_shard for both")

        def ours(policy: api.CommPolicy, unit) -> CustomCollectives:
            if not isinstance(policy, CustomCollectives):
                raise TypeError(
                    f"{what} on unit {unit.name}, sharded by zero.shard with the comm policy "
                    f"{type(policy).__name__}: FSDP2's collective settings are for the units "
                    "zero.fully_shard makes; shard this module with zero.fully_shard, or give "
                    "zero.shard a comm_policy that does what you need")
            return policy
        for unit in units:  # (every unit asked first: a refusal leaves none changed)
            unit.use_comm(partial(ours, unit=unit))
        for unit in units:
            unit.use_comm(partial(change, unit=unit))

    def set_custom_all_gather(self, comm) -> None:
        """FSDP2's ``AllGather`` object gathers this module's parameters."""
        self._change_collectives("set_custom_all_gather", lambda policy, unit: replace(
            policy, all_gather_comm=comm), gathers=True)

    def set_custom_reduce_scatter(self, comm) -> None:
        """FSDP2's ``ReduceScatter`` object reduces this module's gradients."""
        self._change_collectives("set_custom_reduce_scatter", lambda policy, unit: replace(
            policy, reduce_scatter_comm=comm))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """The buffers from the process group's allocator (gloo has none: ``torch.empty``)."""
        what = "set_allocate_memory_from_process_group_for_comm"

        def change(policy: CustomCollectives, unit) -> CustomCollectives:
            _refuse_custom_objects(what, policy)
            return replace(policy, from_group=enable)
        self._change_collectives(what, change, gathers=True)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """The buffers in NCCL's symmetric memory, through torch's own objects."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            SymmMemAllGather, SymmMemReduceScatter)

        def change(policy: CustomCollectives, unit) -> CustomCollectives:
            _refuse_custom_objects("set_symm_mem_for_comm", policy,
                                   (SymmMemAllGather, SymmMemReduceScatter))
            group = cast(dist.ProcessGroup, unit.group or dist.group.WORLD)
            if dist.get_backend(group) != "nccl":
                raise ValueError(
                    f"set_symm_mem_for_comm({backend!r}): symmetric memory is NCCL's, on CUDA; "
                    f"this model's group runs {dist.get_backend(group)} (FSDP2 fails there "
                    "too). Leave the default collectives, or allocate from the process group: "
                    "set_allocate_memory_from_process_group_for_comm(True)")
            return replace(policy, all_gather_comm=SymmMemAllGather(group, backend),
                           reduce_scatter_comm=SymmMemReduceScatter(group, backend)
                           if unit.controls.force_sum else policy.reduce_scatter_comm)
        self._change_collectives("set_symm_mem_for_comm", change, gathers=True)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """The reduce-scatters on a group of their own over the same ranks, not queued behind
        the all-gathers."""
        made: dict = {}

        def change(policy: CustomCollectives, unit) -> CustomCollectives:
            group, groups = unit.group, dict(policy.reduce_scatter_groups)
            if not enable:
                groups.pop(group, None)
                return replace(policy, reduce_scatter_groups=groups)
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            if ranks not in made:  # (every rank of the group makes it: a collective call)
                made[ranks] = groups.get(group) or dist.new_group(
                    list(ranks), use_local_synchronization=True)
            groups[group] = made[ranks]
            return replace(policy, reduce_scatter_groups=groups)
        self._change_collectives("set_separate_reduce_scatter_group", change, recurse)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """Up to this many reduce-scatters in flight (``zero/core/reductions.py``)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for unit in self._units(recurse):
            unit.controls.max_in_flight = max_input_buffers

    # ---- what torch's functions read, and what would detach the parameters ------------------

    def _get_fsdp_state(self):
        """What ``register_fsdp_forward_method`` and ``share_comm_ctx`` read."""
        return FSDPStateView(self._module)

    def to_empty(self, *, device, recurse: bool = True):
        """After ``fully_shard`` on the meta device (``zero/surface/meta_init.py``)."""
        meta_init.to_empty(self._module, device)
        return self

    def _apply(self, fn, *args: Any, **kwargs: Any):
        # ``model.to(the device it is on)`` (Lightning's setup) changes nothing: allowed
        tensors = [*self._module.parameters(), *self._module.buffers()]
        if all(fn(t) is t for t in tensors):
            return self
        raise RuntimeError(
            f"{type(self).__name__}.to() / .half() / .float() / .cuda() after zero.fully_shard "
            "would detach its parameters from their shards: convert the model before sharding, "
            "or compute in another dtype with mp_policy=MixedPrecisionPolicy(param_dtype=...)")

    def __deepcopy__(self, memo):
        raise TypeError(
            "copy.deepcopy of a model sharded by zero is not supported: its parameters are "
            "views into shards that a copy would not share. Copy the model before sharding it")


def _refuse_custom_objects(what: str, policy: CustomCollectives, ours: tuple = ()) -> None:
    """Refuse custom objects (they allocate their own buffers), but ``ours``, the setting's own."""
    if any(c is not None and not isinstance(c, ours)
           for c in (policy.all_gather_comm, policy.reduce_scatter_comm)):
        raise ValueError(f"{what} with a custom all-gather or reduce-scatter "
                         "(set_custom_all_gather / set_custom_reduce_scatter): that object "
                         "allocates its buffers itself (its allocate()); choose one of the two")


def _not_implemented(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"FSDPModule.{name} (new in this torch, after zero was written) is not implemented "
            "by zero.fully_shard: shard this model with torch's fully_shard to use it, or "
            "leave the call out")
    method.__name__ = name
    return method


# A public method of a later torch's FSDPModule: refused by name, never a silent no-op.
for _name in [n for n in vars(FSDPModule) if not n.startswith("_")]:
    if _name not in vars(ZeroFSDPModule):
        setattr(ZeroFSDPModule, _name, _not_implemented(_name))
