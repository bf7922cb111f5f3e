"""``zero.shard``: turn a module into a unit, checking everything that could go wrong first.

Apply it bottom-up, like FSDP2's ``fully_shard``: each call makes one unit out of the
module's parameters that no unit below it owns yet::

    for block in model.blocks:
        zero.shard(block, stage=3)
    zero.shard(model, stage=3)   # the root: embeddings, final norm, head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # after sharding

A call: the groups and the root's context (``_context``); the local checks (``claim.py``) inside
``comm.raising_together``, so a mistake on one rank raises on all; the ranks agree on the model
and its values (``same_model.py``); the units are made (``_make_units``) and hooked (``_install``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from zero import api, comm
from zero.comm.context import CommContext
from zero.comm.flat_collectives import FlatCollectives
from zero.core import hooks, placement, registry, same_model
from zero.core.config import HSDPMeshInfo, MeshInfo, UnitConfig
from zero.core.registry import piece_of, unit_of, units_of, units_on
from zero.core.root import Root
from zero.core.stage import STAGES
from zero.core.state import Controls
from zero.core.unit import Unit
from zero.features import all_gather_extension, wrap
from zero.features.offload import offload_from_torch
from zero.surface import attach
from zero.surface.claim import claim, device_of, named
from zero.surface.controls import no_sync
from zero.surface.options import Options
from zero.surface.policies import MixedPrecision, layout_class

__all__ = ["no_sync", "piece_of", "shard", "unit_of", "units_of", "units_on"]


def shard(
    module: nn.Module | list[nn.Module],
    *,
    stage: int | None = None,
    group=None,
    mp_policy: MixedPrecision | None = None,
    reshard_after_forward: bool | None = None,
    device: torch.device | str | None = None,
    broadcast_buffers: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
    mesh=None,
    secondary_group=None,
    comm_policy=None,
    sync_module_states: bool = False,
    layout="flat",
    auto_wrap_policy=None,
    sharding_strategy=None,
    offload_policy=None,
    prefetch: int | None = None,
    schedule=None,
    backend=None,
    shard_placement_fn=None,
    reduce_scatter_depth: int | None = None,
    _leave: frozenset = frozenset(),
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters across the ranks of ``group`` as one unit.

    Args:
        module: the module; sub-modules already sharded stay their own units. A list makes
            one unit of all (FSDP2's ``fully_shard([a, b])``: an embedding and its tied head).
        stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters; default), one a model.
        group: the process group (default: the world).
        mesh: instead of ``group``, FSDP2's ``DeviceMesh``: 1-D, shard over it; 2-D
            (replicate, shard), HSDP (notes/14-hybrid.md).
        mp_policy: mixed precision (``zero.MixedPrecision``); None: in the parameters' dtype.
        reshard_after_forward: stage 3 only: free the parameters after forward (True) or
            keep them for backward (False). None: False for the root, True otherwise.
        device: where the shards live when ``module`` is on the meta device (default: the
            backend's device); ``zero.init_parameters`` then fills them.
        broadcast_buffers: the root only: copy rank 0's buffers to every rank before each
            forward, as DDP. False (FSDP2's): each rank keeps its own.
        ignored_params: parameters left whole on every rank, their gradients not reduced
            (FSDP2's); keeping them in sync is the caller's business.
        secondary_group: stage 3 only, ZeRO++'s hpZ: the ranks of this rank's node, over
            which each rank keeps its slice after forward, for backward to gather from.
        comm_policy: a ``CommPolicy`` (``zero/api.py``; None: ``FlatCollectives``), such as
            ZeRO++'s ``zero.QuantizedWeights()``.
        sync_module_states: copy rank 0's parameters and buffers to every rank first (FSDP1's
            name). Otherwise ranks whose values differ raise.
        layout: "flat", "rows" (FSDP2's ``Shard(0)`` DTensors), "whole" (each parameter whole on
            one rank: Adafactor, Muon) or a ``Layout`` class; one for a model (notes/16).
        auto_wrap_policy: one of ``torch.distributed.fsdp.wrap``'s policies: a unit of every
            module FSDP1 would wrap, bottom-up, then the root (``zero/features/wrap.py``).
        sharding_strategy: FSDP1's ``ShardingStrategy``, instead of ``stage``: FULL_SHARD
            (3), SHARD_GRAD_OP (2), HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (3 / 2 in each row of a
            2-D ``mesh``), NO_SHARD (DDP).
        offload_policy: ``zero.CPUOffload()`` (or torch's ``CPUOffloadPolicy``): shards,
            gradients, optimizer state and step on the host; ``zero.DiskOffload(directory)``:
            the optimizer state in files too. None: on the compute device.
        prefetch: how many units to gather ahead of the one computing (1, as FSDP2).
        schedule: instead of ``prefetch``, a ``Schedule`` (``zero/api.py``).
        backend: the ``Backend`` every collective goes through (default ``TorchBackend()``;
            ``zero.features.logging_backend.LoggingBackend(path)`` logs each).
        reduce_scatter_depth: stages 2/3, how many reduce-scatters may be in flight (1, as
            FSDP2's ``set_reduce_scatter_max_input_buffers``).
        shard_placement_fn: FSDP2's: returns ``Shard(dim)`` for a parameter (layout "rows";
            the dim must divide evenly).

    A DTensor parameter on a tensor-parallel mesh is sharded as FSDP2 does (layout "rows";
    ``zero/core/placement.py``). ``prefetch``, ``schedule``, ``backend``, ``reduce_scatter_depth``
    are the root's to give: a unit below given others is refused (notes/15, "One context per
    root"). Frozen parameters go into a second unit (``units_on``: one or two; notes/18).

    Returns:
        ``module``, its parameters now this rank's pieces (same names): build the optimizer after.
    """
    options = Options(
        stage=stage, group=group, mesh=mesh, mp_policy=mp_policy, device=device, layout=layout,
        reshard_after_forward=reshard_after_forward, broadcast_buffers=broadcast_buffers,
        ignored_params=ignored_params, secondary_group=secondary_group, comm_policy=comm_policy,
        sync_module_states=sync_module_states, auto_wrap_policy=auto_wrap_policy,
        sharding_strategy=sharding_strategy, offload_policy=offload_policy, prefetch=prefetch,
        schedule=schedule, backend=backend, shard_placement_fn=shard_placement_fn,
        reduce_scatter_depth=reduce_scatter_depth)
    if auto_wrap_policy is not None or sharding_strategy is not None:
        return _shard_by_policy(module, options)
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _shard(modules, options, _leave)
    return module


def _shard(modules: list[nn.Module], o: Options, leave: frozenset) -> None:
    stage = 3 if o.stage is None else o.stage
    offload = offload_from_torch(o.offload_policy)
    mp_policy = o.mp_policy
    if type(mp_policy).__name__ == "MixedPrecisionPolicy":  # torch's: the same four fields
        mp_policy = MixedPrecision.from_torch(mp_policy)
    ignored = {id(p) for p in o.ignored_params or ()} | set(leave)  # (leave: for a unit above)
    ctx, group, replicate_group, all_group = _context(o)
    with comm.raising_together(all_group, ctx=ctx):
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise TypeError("zero.shard takes a module, or a non-empty list of modules")
        if o.secondary_group is not None and stage != 3:
            raise ValueError("secondary_group (hpZ) only applies to stage 3: stages 1 and 2 "
                             "keep their full parameters, so backward gathers nothing")
        device = device_of(modules[0], o.device, ctx.default_device(group))
        layout = layout_class(o.layout)
        _check_seams(o, offload, layout)
        params, locations, children = claim(modules, stage, mp_policy,
                                            o.reshard_after_forward, ignored)
        if _composed(params, o):  # (tensor parallel, Shard(d), the all-gather extension)
            placement.check(layout, named(modules, params), ctx.world_size(group),
                            o.mesh, o.shard_placement_fn)
            all_gather_extension.check(named(modules, params), layout, o.comm_policy, offload,
                                       o.secondary_group)
        if any(child.layout.name != layout.name for child in children):
            raise ValueError(f"the units below {type(modules[0]).__name__} use layout "
                             f"{children[0].layout.name!r}, this call {layout.name!r}: use one "
                             "layout for all units of a model")
        roots_below = list({c.root: None for c in children})
        for below in roots_below:
            Root.refuse_conflicts(o.given_to_root(), below)
    names = named(modules, params)
    _agree_on_the_model(modules, names, params, stage, mp_policy, layout, offload, o, ignored,
                        ctx, all_group)
    root = Root(ctx, o.given_to_root())
    mesh_info = _mesh_info(group, replicate_group, all_group, o, ctx,
                           layout.exposes_dtensors and offload.home(torch.device(device)))
    units, originals = _make_units(modules, params, locations, stage, mp_policy, layout,
                                   offload, device, mesh_info, o, root)
    for below in roots_below:
        root.take(below)
    for child in children:
        if child.parent is None:
            child.place_under(units[0])
    _install(modules, units, originals, locations, names, o)
    attach.watch()  # for the optimizers that will step these units


def _context(o: Options):
    """(context, shard group, replicate group or None, the group of every rank)."""
    if o.backend is not None:  # (checked first: the ranks agree through it)
        api.check(o.backend, api.Backend, "backend")
    ctx = CommContext(o.backend)  # the units of this call, and later every unit under them
    group, replicate_group, all_group = _groups(o.group, o.mesh, ctx)
    if o.secondary_group is not None:
        ctx.name_group(o.secondary_group, "intra-node")
    return ctx, group, replicate_group, all_group


def _check_seams(o: Options, offload, layout) -> None:
    """Every object given for a seam, against its protocol in ``zero/api.py``, by signature."""
    if o.comm_policy is not None:
        api.check(o.comm_policy, api.CommPolicy, "comm_policy")
    api.check(offload, api.OffloadPolicy, "offload_policy")
    api.check(layout, api.Layout, "layout", is_class=True)
    if o.schedule is not None:
        api.check(o.schedule, api.Schedule, "schedule")
        if o.prefetch is not None:
            raise ValueError("give zero.shard prefetch= (the depth of zero's own schedule) or "
                             "schedule= (one of yours, which decides the depth itself), not both")
    if o.prefetch is not None and (type(o.prefetch) is not int or o.prefetch < 0):
        raise ValueError(f"prefetch={o.prefetch!r}: how many units to gather ahead, 0 or more")
    depth = o.reduce_scatter_depth
    if depth is not None and (type(depth) is not int or depth < 1):
        raise ValueError(f"reduce_scatter_depth={depth!r}: how many reduce-scatters may be in "
                         "flight at once, 1 or more")
    offload.check(layout)


def _agree_on_the_model(modules, names, params, stage, mp_policy, layout, offload, o, ignored,
                        ctx, all_group) -> None:
    """The ranks agree on what this call shards, then on its values (or take rank 0's)."""
    desc = [[type(m).__name__ for m in modules], stage, str(mp_policy), o.reshard_after_forward,
            o.broadcast_buffers, sorted(n for m in modules for n, p in m.named_parameters()
                                        if id(p) in ignored)]
    desc += [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in names]
    # Every policy by its parameters, not its class (qwZ's block size decides how each rank
    # reads the others' bytes); a per-rank path (DiskOffload's directory) is left out.
    desc += [("policy", field, value) for field, value in (
        ("layout", layout.name), ("comm_policy", same_model.describe(o.comm_policy)),
        ("offload_policy", same_model.describe(offload)), ("backend", same_model.describe(ctx.backend)),
        ("prefetch", o.prefetch), ("schedule", same_model.describe(o.schedule)),
        ("reduce_scatter_depth", o.reduce_scatter_depth),
        ("mesh", None if o.mesh is None else tuple(o.mesh.shape)),
        ("secondary_group", None if o.secondary_group is None else
         ctx.world_size(o.secondary_group)),
        # (two dims of equal size would exchange the same bytes, scrambled, without a word)
        ("shard_placement_fn", o.shard_placement_fn and [
            placement.chosen_dim(o.shard_placement_fn, n, p) for n, p in names]))]
    desc.append(("values", any(p.is_meta for p in params), o.sync_module_states))
    same_model.check_same_description(desc, all_group, ctx)
    if o.sync_module_states:
        same_model.take_rank0_values(modules, params, all_group, ctx)
    elif not any(p.is_meta for p in params):  # (on the meta device: no values yet)
        same_model.check_same_values(names, all_group, ctx)


def _make_units(modules, params, locations, stage, mp_policy, layout, offload, device,
                mesh_info, o: Options, root) -> tuple[list[Unit], list[list]]:
    """One unit of the trainable parameters, and one of the frozen ones (no gradient) beside it."""
    groups = [[i for i, p in enumerate(params) if p.requires_grad == trainable]
              for trainable in (True, False)]
    groups = [g for g in groups if g] or [[]]
    comm_policy = o.comm_policy or FlatCollectives()
    composed = _composed(params, o)
    units = []
    for k, g in enumerate(groups):
        mine = [params[i] for i in g]
        master_dtype = mine[0].dtype if g else torch.float32
        placed, laid, forms = layout, mine, []
        if composed:  # a layout placing tensor-parallel and Shard(d) parameters, and what it
            placed, laid, placements = placement.lay_out(  # lays out
                layout, mine, mesh_info.world_size, o.shard_placement_fn)
        config = UnitConfig.make(STAGES[stage], mp_policy, master_dtype, placed, comm_policy,
                                 offload, device)
        if composed:  # each parameter's own form: a DTensor on its tensor-parallel mesh, or a
            forms = [tp or sub for tp, sub in zip(  # tensor subclass deciding its all-gather
                placement.forms(placements), all_gather_extension.forms(mine, config))]
        controls = Controls(reshard_after_forward=o.reshard_after_forward,
                            broadcast_buffers=o.broadcast_buffers and k == 0)
        units.append(Unit(modules, laid, [locations[i] for i in g], config, mesh_info,
                          controls, root, forms))
    root.add(units)
    for sibling in units[1:]:  # the trainable one, if any: the others follow it
        sibling.place_under(units[0], sibling=True)
    return units, [[params[i] for i in g] for g in groups]


def _composed(params, o: Options) -> bool:
    """Whether a parameter is a DTensor or a tensor subclass, or ``Shard(d)`` is asked for."""
    return o.shard_placement_fn is not None or any(
        type(p) not in (torch.Tensor, nn.Parameter) for p in params)


def _install(modules, units, originals, locations, names, o: Options) -> None:
    """The units take their modules' places: pieces in, originals marked, hooks on."""
    for p in o.ignored_params or ():
        registry.mark_ignored(p)
    for u, replaced in zip(units, originals):
        attach.replace(replaced, u, names)
        u.use_sharded_params()
    for m in modules:
        registry.attach(m, units)
    for u in units:
        hooks.install(u)
    attach.install(modules + [mod for locs in locations for mod, _ in locs])
    for u in units:
        if u.materialized:  # stages 1/2: every rank starts from the same full parameters
            u.shard_changed(phase="init")


def _shard_by_policy(model, o: Options):
    """FSDP1's one call: units where the policy says, bottom-up, then the root."""
    if isinstance(model, (list, tuple)):
        raise TypeError("auto_wrap_policy and sharding_strategy take one model, not a list")
    stage, mesh = o.stage, o.mesh
    if o.sharding_strategy is not None:
        device = next(iter(model.parameters()), None)
        device_type = device.device.type if device is not None else "cpu"
        stage, mesh = wrap.stage_and_mesh(o.sharding_strategy, stage, mesh,
                                          CommContext(o.backend).world_size(o.group),
                                          device_type)
    stage = 3 if stage is None else stage
    policy = o.auto_wrap_policy
    o = dataclasses.replace(o, stage=stage, mesh=mesh, auto_wrap_policy=None,
                            sharding_strategy=None,  # (the strategy decides: ZeRO-2 keeps them)
                            reshard_after_forward=o.reshard_after_forward if stage == 3 else None)
    if policy is not None:
        for module in wrap.units_by_policy(model, policy, o.ignored_params):
            # A tied parameter belongs to the lowest unit holding all its users (not FSDP1's)
            _shard([module], o, wrap.shared_outside(model, module))
    _shard([model], o, frozenset())
    return model


def _groups(group, mesh, ctx):
    """(shard group, replicate group or None, the group of every rank) from FSDP2's ``mesh``."""
    if mesh is None:
        return group, None, group
    if group is not None:
        raise ValueError("give zero.shard a group or a mesh, not both")
    if mesh.ndim == 1:
        return mesh.get_group(0), None, mesh.get_group(0)
    if mesh.ndim != 2:
        raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D")
    shard, replicate = mesh.get_group(1), mesh.get_group(0)
    ctx.name_group(shard, "intra-node")  # HSDP shards within a node, replicates across
    ctx.name_group(replicate, "inter-node")
    return shard, replicate, _mesh_group(mesh, ctx)


def _mesh_info(group, replicate_group, all_group, o: Options, ctx, dtensors_on):
    """Its group, HSDP's replicas, hpZ's node; ``dtensors_on``: the DTensors' device, if any."""
    placement = o.mesh
    if o.mesh is None:  # (making a mesh moves no data: torch's own, notes/15)
        placement = DeviceMesh.from_group(group or ctx.backend.world(), dtensors_on.type) \
            if dtensors_on else group
    post_forward = None if o.secondary_group is None else MeshInfo.over(ctx, o.secondary_group)
    if replicate_group is None:
        return MeshInfo.over(ctx, group, all_group, placement, post_forward)
    return HSDPMeshInfo.over(ctx, group, all_group, placement, post_forward,
                             replicas=ctx.world_size(replicate_group),
                             replicate_group=replicate_group)


def _mesh_group(mesh, ctx):
    """The group of all of a mesh's ranks (the world, when the mesh spans it)."""
    if mesh.size() == ctx.world_size():
        return None
    if not hasattr(mesh, "_zero_all_group"):  # (making a group moves no data: notes/15)
        # A slice of a larger mesh: _flatten makes every slice's group on every rank, in one order
        mesh._zero_all_group = (mesh._flatten().get_group() if mesh.mesh_dim_names
                                else dist.new_group(sorted(mesh.mesh.flatten().tolist())))
    return mesh._zero_all_group
