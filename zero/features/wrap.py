"""Wrapping as a policy: which modules become units, from one call on the whole model.

``zero.shard(model, auto_wrap_policy=...)`` asks torch's own FSDP1 policies
(``ModuleWrapPolicy``, ``size_based_auto_wrap_policy``, ...), with FSDP1's own traversal,
which modules to wrap, and makes the same units FSDP1 does (notes/09-scale.md, "Units"). The
strategy names map to stages (``STAGES``; ``HYBRID_SHARD``: HSDP, ``NO_SHARD``: DDP).
"""

from __future__ import annotations

import torch.nn as nn

STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2,
          "NO_SHARD": 1}
HYBRID = {"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"}


def units_by_policy(model: nn.Module, policy, ignored_params=None) -> list[nn.Module]:
    """The modules FSDP1's auto-wrap would wrap, bottom-up, the root not included; ``policy``
    is ``torch.distributed.fsdp.wrap``'s: a ``_Policy`` or a callable (``functools.partial``)."""
    from torch.distributed.fsdp.wrap import _Policy, _post_order_apply, _recursive_wrap

    found: list[nn.Module] = []
    if isinstance(policy, _Policy):  # FSDP1's _auto_wrap: the targets, then a post-order walk
        targets = policy._run_policy(model, set(), {})

        def visit(module):
            if module in targets and module is not model:
                found.append(module)

        _post_order_apply(model, visit)
    else:  # a callable: FSDP1's _recursive_wrap, with a "wrapper" that only writes down
        class _Noted:
            def __new__(cls, module, **kwargs):
                found.append(module)
                return module

        _recursive_wrap(model, policy, _Noted, set(), set(ignored_params or ()),
                        only_wrap_children=True)
    return found


def shared_outside(model: nn.Module, module: nn.Module) -> frozenset:
    """Ids of ``module``'s parameters that a module outside it uses too (tied weights)."""
    inside = {id(m) for m in module.modules()}
    users: dict[int, set] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(id(m))
    return frozenset(pid for pid, mods in users.items() if mods & inside and not mods <= inside)


def stage_and_mesh(strategy, stage: int | None, mesh, world_size: int, device_type: str):
    """(stage, mesh) for an FSDP1 ``ShardingStrategy``; an unsupported one is refused by name."""
    name = getattr(strategy, "name", strategy)
    if name not in STAGES:
        raise ValueError(f"sharding_strategy {name!r} is not one zero maps to a stage: use one of "
                         f"{sorted(STAGES)}")
    if stage is not None and stage != STAGES[name]:
        raise ValueError(f"sharding_strategy={name} is ZeRO-{STAGES[name]}, but stage={stage}: "
                         "give one or the other")
    if name in HYBRID:
        if mesh is None or mesh.ndim != 2:
            raise ValueError(f"sharding_strategy={name} shards within a group of ranks (a node) "
                             "and replicates across groups: pass mesh=init_device_mesh(device, "
                             "(replicas, ranks_per_replica))")
    elif name == "NO_SHARD":
        if mesh is not None:
            raise ValueError("sharding_strategy=NO_SHARD replicates over every rank: no mesh")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world_size, 1))  # shards of one rank, N replicas
    elif mesh is not None and mesh.ndim != 1:
        raise ValueError(f"sharding_strategy={name} shards over every rank of a 1-D mesh; a 2-D "
                         "mesh is HYBRID_SHARD")
    return STAGES[name], mesh
