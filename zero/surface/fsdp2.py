"""``zero.fully_shard``: FSDP2's ``fully_shard``, argument for argument, over zero's mechanism.

Code written for FSDP2 (torchtitan) asks ``isinstance(module, FSDPModule)``, calls its methods,
reads DTensor parameters and saves through DCP, and silently skips what it does not find (a
divide factor never set halves the gradients). So the module's class becomes ``FSDP<Class>``, a
subclass of torch's ``FSDPModule`` and of the original (``fsdp2_module.py``); the layout is
"rows", so training is bitwise FSDP2's; each unit's collectives go through
``zero/features/custom_collectives.py``; each FSDP2 argument is taken or refused by name
(notes/11-conformance.md, "FSDP2's surface, item by item"). At ``stage`` 1 and 2 the calls that
free the parameters warn (``not_freed``). torchtitan: ``benchmarks/torchtitan_example.py``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.core import registry
from zero.features.custom_collectives import CustomCollectives
from zero.surface.fsdp2_module import ZeroFSDPModule, not_freed
from zero.surface.policies import MixedPrecision
from zero.surface.shard import shard


def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn=None,
                mp_policy=None, offload_policy=None, ignored_params=None, dp_mesh_dims=None,
                stage: int = 3, layout: str = "rows", device=None, backend=None,
                prefetch: int | None = None, schedule=None,
                reduce_scatter_depth: int | None = None):
    """Shard ``module`` as FSDP2's ``fully_shard`` does (see the module docstring).

    Args:
        module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
            ignored_params, dp_mesh_dims: FSDP2's; each taken or refused by name.
        stage: the ZeRO stage, 1, 2 or 3. At 1 and 2 the parameters stay gathered, so
            ``reshard_after_forward`` does not apply (``True`` warns that it is not honoured).
        layout: "rows" (FSDP2's, the default), "flat" or "whole" (``zero.shard``).
        device: where the shards live when ``module`` is on the meta device.
        backend, prefetch, schedule, reduce_scatter_depth: ``zero.shard``'s, the root's to
            give (``set_reduce_scatter_max_input_buffers`` sets the depth too, as on FSDP2).

    Returns:
        ``module``, its class now ``FSDP<Class>`` (an ``FSDPModule``).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    reshard_after_forward, secondary_group = _reshard_after_forward(reshard_after_forward,
                                                                    stage, mesh)
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...) (parameters as DTensors on a larger SPMD mesh) is "
            "not supported by zero: give the data-parallel mesh itself (torchtitan: "
            "parallelism.spmd_backend='partial_dtensor')")
    if stage != 3 and reshard_after_forward:
        not_freed(f"fully_shard(stage={stage}, reshard_after_forward=True)")
    if layout != "rows":
        _warn_layout(layout)
    if mp_policy is not None:
        mp_policy = MixedPrecision.from_torch(mp_policy)
        if mp_policy == MixedPrecision():
            mp_policy = None  # FSDP2's default policy: compute as stored
    shard(modules if len(modules) > 1 else modules[0], stage=stage, mesh=mesh, device=device,
          mp_policy=mp_policy, reshard_after_forward=reshard_after_forward if stage == 3 else None,
          ignored_params=ignored_params, layout=layout, offload_policy=offload_policy,
          secondary_group=secondary_group, shard_placement_fn=shard_placement_fn, backend=backend,
          prefetch=prefetch, schedule=schedule, reduce_scatter_depth=reduce_scatter_depth,
          comm_policy=CustomCollectives())  # (zero's own until set_custom_* replace it)
    for unit in registry.units_on(modules[0]):
        if not unit.materialized:  # FSDP2: on meta until to_empty (or a load) gives values
            unit.params_on_meta()
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
    return module


def _reshard_after_forward(value, stage: int, mesh) -> tuple[bool | None, object]:
    """FSDP2's ``reshard_after_forward`` as zero's: (bool or None, hpZ's group or None)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if stage != 3:
            not_freed(f"fully_shard(stage={stage}, reshard_after_forward={value})")
            return None, None
        return _post_forward_group(value, mesh)
    if value is not None and not isinstance(value, bool):
        raise ValueError("reshard_after_forward should be a bool or an int representing the "
                         f"group size to reshard to, not {value!r}")
    return value, None


def _warn_layout(layout: str) -> None:
    """Another layout than FSDP2's: what its clients then miss, as the warning says."""
    warnings.warn(
        f"fully_shard(layout={layout!r}): torch.nn.utils.clip_grad_norm_ on this model "
        "clips each rank by the norm of its own share of the gradients (each rank a "
        "different factor): clip with zero.clip_grad_norm_(model, max_norm); and clients "
        "that look for DTensor parameters (Lightning's ModelParallelStrategy: its "
        "checkpoints and its meta-device init) do not find them. Keep layout='rows', "
        "FSDP2's, whose DTensor parameters and gradients they read whole", stacklevel=3)


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``, made once per class and kept on it (FSDP2 keeps a table of them)."""
    made = cls.__dict__.get("_zero_fsdp_class")
    if made is None:
        made = type(f"FSDP{cls.__name__}", (ZeroFSDPModule, cls), {})
        setattr(cls, "_zero_fsdp_class", made)
    return made


def _post_forward_group(k: int, mesh) -> tuple[bool, object]:
    """FSDP2's ``reshard_after_forward=k`` (zero's hpZ): (True, this rank's k consecutive ranks)."""
    ranks = (torch.arange(dist.get_world_size()) if mesh is None
             else mesh.mesh.flatten())  # (FSDP2: mesh.mesh.view(-1, k), replicas flattened)
    size = len(ranks) if mesh is None else mesh.size(mesh.ndim - 1)
    if not 1 <= k <= size or size % k:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor "
                         f"of {size} (the shard group's size), not {k}")
    if k == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world "
                      "size 1, instead of reshard_after_forward=True (bool): not resharded",
                      stacklevel=3)
        return False, None
    if k == size:
        return True, None
    made = getattr(mesh, "_zero_post_forward_groups", {})
    if k not in made:
        rank = dist.get_rank()
        for row in ranks.view(-1, k).tolist():  # every rank makes every group, in one order
            group = dist.new_group(row)
            if rank in row:
                made[k] = group
        if mesh is not None:
            mesh._zero_post_forward_groups = made
    return True, made[k]
