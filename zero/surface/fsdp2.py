"""``zero.fully_shard``: FSDP2's ``fully_shard``, argument for argument, over zero's mechanism.

Code written for FSDP2 (torchtitan is the largest) talks to more than ``fully_shard``: it asks
``isinstance(module, FSDPModule)`` and calls the module's methods (``set_gradient_divide_factor``,
``unshard``, ``set_requires_gradient_sync``...), reads DTensor parameters, and saves through
DCP's state-dict functions. Where it does not find them it skips them, silently: a gradient
divide factor never set halves the gradients. So this entry point does what ``fully_shard``
does to a module, with ``zero.shard`` underneath:

- it swaps the module's class for ``FSDP<Class>``, a subclass of torch's ``FSDPModule`` and of
  the original class, whose FSDP2 methods act on zero's units (``ZeroFSDPModule``); every FSDP2
  method zero does not implement raises ``NotImplementedError`` naming it;
- its default layout is "rows", FSDP2's, so the parameters are ``Shard(0)`` DTensors and the
  training is bitwise FSDP2's (``zero/core/rows.py``);
- each FSDP2 argument is taken or refused by name: ``mesh`` (1-D; or 2-D, (replicate,
  shard): HSDP, parameters placed ``(Replicate(), Shard(0))`` as FSDP2's), ``reshard_after_forward`` (stage 3's; an int, FSDP2's reshard to a smaller
  group, is refused), ``mp_policy`` (torch's ``MixedPrecisionPolicy`` or ours),
  ``offload_policy`` (torch's ``CPUOffloadPolicy`` or ours: ``zero/features/offload.py``),
  ``ignored_params``, ``shard_placement_fn`` (``Shard(dim)``, any dim that divides, as
  FSDP2's), ``dp_mesh_dims`` (None only). ``stage`` picks the ZeRO stage (3 by default, as ``fully_shard``).

At stages 1 and 2 the full parameters stay between steps: that is what those stages are. The
FSDP2 calls that ask to free them (``reshard_after_forward=True``, which torchtitan passes for
every block, ``set_reshard_after_forward/backward(True)``, which its chunked loss makes every
step) are accepted and warn that they are not honoured; asking to keep them is what happens.

``zero.shard`` stays the teaching entry point; both make the same units. torchtitan trains on
this unchanged, bitwise FSDP2's: ``benchmarks/torchtitan_example.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from zero.surface import controls
from zero.core import registry
from zero.surface.policies import MixedPrecision
from zero.surface.shard import shard



def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn=None,
                mp_policy=None, offload_policy=None, ignored_params=None, dp_mesh_dims=None,
                stage: int = 3, layout: str = "rows", device=None):
    """Shard ``module`` as FSDP2's ``fully_shard`` does (see the module docstring).

    Args:
        module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
            ignored_params, dp_mesh_dims: FSDP2's; each taken or refused by name.
        stage: the ZeRO stage, 1, 2 or 3. At stages 1 and 2 the parameters stay gathered
            by definition, so ``reshard_after_forward`` does not apply there (``True`` warns
            that it is not honoured).
        layout: "rows" (FSDP2's, the default), "flat" or "whole" (``zero.shard``).
        device: where the shards live when ``module`` is on the meta device.

    Returns:
        ``module``, its class now ``FSDP<Class>`` (an ``FSDPModule``).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            "fully_shard(reshard_after_forward=<int>) (FSDP2's reshard to a smaller group, "
            "ZeRO++'s hpZ) is not supported here: use zero.shard(..., secondary_group=...) with "
            "layout='flat'")
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...) (parameters as DTensors on a larger SPMD mesh) is "
            "not supported by zero: give the data-parallel mesh itself (torchtitan: "
            "parallelism.spmd_backend='partial_dtensor')")
    if stage != 3 and reshard_after_forward:
        _not_freed(f"fully_shard(stage={stage}, reshard_after_forward=True)")
    if layout != "rows":
        # FSDP2's clients (accelerate, the HF Trainer, Lightning, torchtune) clip with torch's
        # clip_grad_norm_, which computes a norm of what it is given: with rows that is
        # DTensors, whose norm is global; with the other layouts it is this rank's share, and
        # each rank would clip by its own factor, silently.
        warnings.warn(
            f"fully_shard(layout={layout!r}): torch.nn.utils.clip_grad_norm_ on this model "
            "clips each rank by the norm of its own share of the gradients (each rank a "
            "different factor): clip with zero.clip_grad_norm_(model, max_norm), or keep "
            "layout='rows', FSDP2's, whose DTensor gradients torch's clipping reads whole",
            stacklevel=2)
    if mp_policy is not None:
        mp_policy = MixedPrecision.from_torch(mp_policy)
        if mp_policy == MixedPrecision():
            mp_policy = None  # FSDP2's default policy: compute as stored
    shard(modules if len(modules) > 1 else modules[0], stage=stage, mesh=mesh,
          mp_policy=mp_policy, reshard_after_forward=reshard_after_forward if stage == 3 else None,
          ignored_params=ignored_params, layout=layout, device=device,
          offload_policy=offload_policy, shard_placement_fn=shard_placement_fn)
    for unit in registry.units_on(modules[0]):
        if not unit.materialized:  # FSDP2: on meta until to_empty (or a load) gives values
            unit.params_on_meta()
    for m in modules:
        cls = type(m)
        m.__class__ = _fsdp_class(cls)
    return module


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``, made once per class and kept on it (FSDP2 keeps a table of them)."""
    made = cls.__dict__.get("_zero_fsdp_class")
    if made is None:
        made = type(f"FSDP{cls.__name__}", (ZeroFSDPModule, cls), {})
        cls._zero_fsdp_class = made
    return made


def _not_freed(call: str) -> None:
    """Stages 1 and 2 keep the full parameters between steps: that is what the stage is. An
    FSDP2 call asking to free them is accepted (code written for FSDP2 makes it as a matter
    of course) and says once that it is not honoured; asking to keep them is what happens."""
    warnings.warn(f"{call}: stages 1 and 2 keep the parameters between forward and backward "
                  "and between steps; use stage=3 to free them", stacklevel=3)


class ZeroFSDPModule(FSDPModule):
    """FSDP2's module methods over zero's units (mixed into ``FSDP<Class>``).

    As in FSDP2, each acts on the units this module's ``fully_shard`` made, and ``recurse``
    extends it to the units below.
    """

    _orig_cls_mro_index = 3  # [FSDP<Class>, ZeroFSDPModule, FSDPModule, Class, ...]

    def _units(self, recurse: bool = False) -> list:
        return registry.units_of(self) if recurse else registry.units_on(self)

    def unshard(self, async_op: bool = False):
        """Gather this module's parameters (not the units below, as FSDP2), and keep them
        gathered until ``reshard()`` (``zero.unshard``)."""
        return controls.unshard(self, async_op=async_op)

    def reshard(self) -> None:
        controls.reshard(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        controls.set_requires_gradient_sync(self, requires_gradient_sync, recurse=recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Stage 3's knob. At stages 1 and 2 the parameters stay gathered (``_not_freed``);
        torchtitan's chunked loss sets it False on ``lm_head``, then True again."""
        for unit in self._units(recurse):
            if unit.config.stage.frees_parameters:
                unit.controls.reshard_after_forward = reshard_after_forward
            elif reshard_after_forward:
                _not_freed(f"set_reshard_after_forward(True) at stage {unit.config.stage.number}")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Stage 3 (at stages 1 and 2 the parameters stay gathered, as ``_not_freed`` says)."""
        if reshard_after_backward and any(not u.config.stage.frees_parameters
                                          for u in self._units(recurse)):
            _not_freed("set_reshard_after_backward(True)")
        controls.set_reshard_after_backward(self, reshard_after_backward, recurse=recurse)

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        controls.set_modules_to_forward_prefetch(self, modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        controls.set_modules_to_backward_prefetch(self, modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce with a sum and divide by ``factor`` (FSDP2's arithmetic, ``divide_factors``):
        1.0 for code that divides its loss itself (torchtitan divides by the global token
        count)."""
        for unit in self._units():
            unit.grads.divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only sums on the wire; the division after (FSDP2's, for backends without AVG)."""
        for unit in self._units():
            unit.grads.force_sum = enable

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's all-reduce over the replicas. Without replicas there is none to skip."""
        if not requires_all_reduce and any(u.replicate_group is not None
                                           for u in self._units(recurse)):
            raise NotImplementedError("set_requires_all_reduce(False) with HSDP is not "
                                      "supported by zero: every backward all-reduces")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        if not is_last_backward:
            raise NotImplementedError("set_is_last_backward(False) is not supported by zero: "
                                      "every backward ends its reductions")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        if not unshard_in_backward:
            raise NotImplementedError("set_unshard_in_backward(False) is not supported by zero: "
                                      "a unit's backward always gathers its parameters")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next all-gathers must follow the optimizer step: zero's collectives are issued
        on the current stream after it, so waiting for the event here is enough."""
        event.wait()

    def _get_fsdp_state(self):
        """What ``register_fsdp_forward_method`` asks for (the HF Trainer registers
        ``generate``): the pre- and post-forward around a method that is not ``forward``."""
        return _ForwardMethodState()

    def to_empty(self, *, device, recurse: bool = True):
        """After ``fully_shard`` on the meta device: the shards already live on their device;
        give the rest (buffers, ignored parameters) memory there, uninitialised, as
        ``nn.Module.to_empty`` does, and leave the values to the model's own init."""
        device = torch.device(device)
        units = registry.units_of(self)
        where = units[0].sharded.device
        if device.type != where.type or (device.type != "cpu" and device.index is not None
                                         and device.index != where.index):
            raise ValueError(
                f"to_empty(device={device}) but the shards of this model live on {where}: "
                "shard it for that device (zero.fully_shard(..., device=...)), or initialise "
                "from the meta device with zero.init_parameters(model, init_fn)")
        for m in self.modules():
            for name, t in list(m._buffers.items()):
                if t is not None and t.is_meta:
                    m._buffers[name] = torch.empty_like(t, device=device)
            for name, p in list(m._parameters.items()):
                if p is not None and p.is_meta and not registry.is_piece(p):
                    m._parameters[name] = nn.Parameter(torch.empty_like(p, device=device),
                                                       requires_grad=p.requires_grad)
        for unit in units:
            unit.params_on_shard()  # each parameter, the same object, now shows its pieces
            unit.materialized = True  # the model's init writes the shards (through DTensors)
        return self

    def _apply(self, fn, *args: Any, **kwargs: Any):
        # ``model.to(the device it is on)`` (Lightning's setup) changes nothing: every tensor
        # converts to itself. Anything else would swap the shards' data for copies.
        tensors = [*self.parameters(), *self.buffers()]
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


class _ForwardMethodState:
    """``register_fsdp_forward_method``'s view of a module's FSDP state: around the method,
    the module's own unit is gathered and kept (``zero.unshard``), then let go
    (``zero.reshard``); the forwards the method runs inside gather the units below as usual.
    Any other question about FSDP2's internals (FSDPMemTracker's) is refused by name."""

    def _pre_forward(self, module, args, kwargs):
        controls.unshard(module)
        return args, kwargs

    def _post_forward(self, module, args, output):
        controls.reshard(module)
        return output

    def __getattr__(self, name: str):
        raise NotImplementedError(
            f"FSDP2's state.{name}: a model sharded by zero.fully_shard has no FSDP2 state for "
            "torch's internals (FSDPMemTracker, say) to read; use "
            "zerolab.trackers.ZeroMemTracker")


def _not_implemented(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"FSDPModule.{name} is not implemented by zero.fully_shard")
    method.__name__ = name
    return method


# Every other public method of torch's FSDPModule: refused by name, never a silent no-op.
for _name in [n for n in vars(FSDPModule) if not n.startswith("_")]:
    if _name not in vars(ZeroFSDPModule):
        setattr(ZeroFSDPModule, _name, _not_implemented(_name))
