"""``zero.shard``: turn a module into a unit, checking everything that could go wrong first.

Apply it bottom-up, like FSDP2's ``fully_shard``: each call makes one unit out of the
module's parameters that no unit below it owns yet::

    for block in model.blocks:
        zero.shard(block, stage=3)
    zero.shard(model, stage=3)   # the root: embeddings, final norm, head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # after sharding

Every check runs on every rank before the first collective, and the ranks agree on the
outcome (``comm.raising_together``, ``comm.agree``): a mistake on one rank raises on all of them, none hangs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from zero import api, comm
from zero.core import same_model
from zero.features import wrap
from zero.surface import attach
from zero.comm.context import CommContext
from zero.comm.flat_collectives import FlatCollectives
from zero.core import hooks, registry
from zero.core.registry import piece_of, unit_of, units_of, units_on
from zero.core.config import HSDPMeshInfo, MeshInfo, UnitConfig
from zero.core.stage import STAGES
from zero.core.state import Controls
from zero.core.unit import Unit
from zero.features.offload import offload_from_torch
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
    prefetch: int = 1,
    backend=None,
    _leave: frozenset = frozenset(),
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters across the ranks of ``group`` as one unit.

    Args:
        module: the module; its sub-modules already sharded stay their own units. A list of
            modules makes one unit of all of them (FSDP2's ``fully_shard([a, b])``): an
            embedding and the head tied to it, say; the unit is gathered from the first of
            them to run forward until all have run.
        stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters; the default). All
            units of one model use one stage.
        group: the process group (default: the world).
        mesh: instead of ``group``, a ``DeviceMesh`` as FSDP2's ``fully_shard`` takes it: 1-D,
            shard over it; 2-D with dims (replicate, shard), HSDP: shard within each row of
            ranks (a node, say), keep one such copy per row, and average the reduced gradient
            shards across rows (notes/14-hybrid.md).
        mp_policy: mixed precision (``zero.MixedPrecision``); None computes in the
            parameters' dtype.
        reshard_after_forward: stage 3 only. Free the parameters after forward and gather
            them again for backward (True), or keep them until the unit's backward is done
            (False: FSDP2's ZeRO-2-like mode). None: False for the root, True otherwise.
        device: where the shards live when ``module`` is on the meta device (default: the
            current accelerator for an accelerator backend, else the CPU); each rank then
            allocates only its own shards, and ``zero.init_parameters`` fills them.
        broadcast_buffers: the root only. Like DDP, copy rank 0's buffers (BatchNorm's
            running statistics) to every rank before each forward. False (FSDP2's way):
            each rank keeps its own buffers, which drift apart if forward updates them.
        ignored_params: parameters to leave as they are: whole on every rank, not sharded,
            their gradients not reduced (FSDP2's ``ignored_params``); keeping them in sync
            is the caller's business. ``zero.clip_grad_norm_`` counts them once.
        secondary_group: stage 3 only, ZeRO++'s hpZ: the ranks of this rank's node. After
            forward each rank keeps its slice of the unit's parameters over the node (a
            secondary shard, P / ranks-per-node), and backward gathers them within the node
            only; the gradient is still reduced over ``group``.
        comm_policy: how the unit's flat buffers cross the ranks: an object with
            ``all_gather`` and ``reduce_scatter`` as ``zero/comm/flat_collectives.py``'s
            ``FlatCollectives`` (None: that one, cast then in place).
        sync_module_states: copy rank 0's values of the unit's parameters and buffers to
            every rank first (FSDP1's name; DDP always does): for weights loaded on rank 0
            only. Otherwise every rank must hold the same values already: a fingerprint
            of them is compared, and ranks that differ raise (a model that is half
            random init trains silently otherwise).
        layout: which rank holds which element (``zero.surface.policies.LAYOUTS``): "flat" (the
            default: the unit's parameters end to end, cut in N equal slices; each parameter
            shows this rank's 1-D piece), "rows" (FSDP2's: each parameter cut along dim 0,
            shown as a ``Shard(0)`` DTensor of its full shape), or "whole" (each parameter
            whole on one rank, for optimizers that read whole tensors: Adafactor, Muon). All
            units of one model use one layout. notes/16-layouts.md compares them.

        auto_wrap_policy: one of ``torch.distributed.fsdp.wrap``'s policies
            (``ModuleWrapPolicy({Block})``, ``size_based_auto_wrap_policy``...): called once on
            the whole model, make a unit of every module FSDP1 would wrap, bottom-up, then of
            the root (``zero/features/wrap.py``).
        offload_policy: ``zero.CPUOffload()`` (or torch's ``CPUOffloadPolicy``): the shards,
            their gradients and the optimizer state live on the host, and ``opt.step()`` runs
            there (ZeRO-Offload; ``zero/features/offload.py``); ``zero.DiskOffload(directory)``: and the
            optimizer state in files, one unit's at a time in memory (ZeRO-Infinity's disk
            tier; ``zero/features/disk_offload.py``). None: on the compute device.
        prefetch: the root only: how many units to gather ahead of the one computing, in
            forward (the next ones to run) and in backward (the ones before it); 1 by default,
            as FSDP2 (``zero/core/schedule.py``).
        backend: the ``Backend`` every collective of this unit goes through (``zero/api.py``;
            default ``zero.comm.backend.TorchBackend()``, ``torch.distributed`` itself):
            ``zero.features.logging_backend.LoggingBackend(path)`` writes each one to a file.
        sharding_strategy: FSDP1's ``ShardingStrategy``, instead of ``stage``: FULL_SHARD
            (3), SHARD_GRAD_OP (2), HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (3 / 2 within each row
            of a 2-D ``mesh``), NO_SHARD (DDP: every rank holds everything, gradients averaged).

    Frozen parameters (``requires_grad=False`` at this call) go into a second unit beside the
    trainable ones, with no gradient to form or reduce (a LoRA model's base weights); both
    are gathered together, and at stage 3 the frozen one is freed once the gradient of the
    module's input no longer needs it (``units_on``; notes/04-stage2.md).

    Returns:
        ``module``, whose parameters are now this rank's pieces (same names). Build the
        optimizer after this call.
    """
    if auto_wrap_policy is not None or sharding_strategy is not None:
        kwargs = dict(group=group, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                      device=device, ignored_params=ignored_params, secondary_group=secondary_group,
                      comm_policy=comm_policy, sync_module_states=sync_module_states,
                      layout=layout, offload_policy=offload_policy, prefetch=prefetch,
                      backend=backend)
        return _shard_by_policy(module, stage, mesh, auto_wrap_policy, sharding_strategy, kwargs)
    stage = 3 if stage is None else stage
    offload_policy = offload_from_torch(offload_policy)
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if type(mp_policy).__name__ == "MixedPrecisionPolicy":  # torch's: the same four fields
        mp_policy = MixedPrecision.from_torch(mp_policy)
    ignored = {id(p) for p in ignored_params or ()} | set(_leave)  # (_leave: for a unit above)
    if backend is not None:  # (checked first: the ranks agree through it)
        api.check(backend, api.Backend, "backend")
    ctx = CommContext(backend)  # every collective of this call's units goes through it
    group, replicate_group, all_group = _groups(group, mesh, ctx)
    if secondary_group is not None:
        ctx.name_group(secondary_group, "intra-node")
    with comm.raising_together(all_group, ctx=ctx):
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise TypeError("zero.shard takes a module, or a non-empty list of modules")
        if secondary_group is not None and stage != 3:
            raise ValueError("secondary_group (hpZ) only applies to stage 3: stages 1 and 2 "
                             "keep their full parameters, so backward gathers nothing")
        device = _device(modules[0], group, device)
        layout = layout_class(layout)
        if comm_policy is not None:
            api.check(comm_policy, api.CommPolicy, "comm_policy")
        api.check(offload_policy, api.OffloadPolicy, "offload_policy")
        api.check(layout(((2,),), 1), api.Layout, "layout")
        if type(prefetch) is not int or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r}: how many units to gather ahead, 0 or more")
        offload_policy.check(layout)
        if layout.copies and secondary_group is not None:
            raise ValueError(f"layout={layout.name!r} is not supported with hpZ (a "
                             "secondary_group) yet: use layout='flat' there")
        params, locations, children = _check(modules, stage, mp_policy, reshard_after_forward,
                                             ignored)
        if any(child.layout.name != layout.name for child in children):
            raise ValueError(f"the units below {type(modules[0]).__name__} use layout "
                             f"{children[0].layout.name!r}, this call {layout.name!r}: use one "
                             "layout for all units of a model")
    names = _names(modules, params)
    desc = [[type(m).__name__ for m in modules], stage, str(mp_policy), reshard_after_forward,
            broadcast_buffers, sorted(n for m in modules for n, p in m.named_parameters()
                                      if id(p) in ignored)]
    desc += [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in names]
    # Every policy by its parameters, not its class (qwZ's block size decides how each rank
    # reads the others' bytes); a per-rank path (DiskOffload's directory) is left out.
    desc += [("policy", field, value) for field, value in (
        ("layout", layout.name), ("comm_policy", same_model.describe(comm_policy)),
        ("offload_policy", same_model.describe(offload_policy)),
        ("backend", same_model.describe(ctx.backend)),
        ("prefetch", prefetch), ("mesh", None if mesh is None else tuple(mesh.shape)),
        ("secondary_group", None if secondary_group is None else
         ctx.backend.world_size(secondary_group)))]
    desc.append(("values", any(p.is_meta for p in params), sync_module_states))
    same_model.check_same_description(desc, all_group, ctx)
    if sync_module_states:
        same_model.take_rank0_values(modules, params, all_group, ctx)
    elif not any(p.is_meta for p in params):  # (on the meta device: no values yet)
        same_model.check_same_values(names, all_group, ctx)

    # Frozen parameters get a unit of their own, beside the trainable ones: no gradient is
    # ever formed, reduced or stored for them (a LoRA model's frozen base weights).
    groups = [[i for i, p in enumerate(params) if p.requires_grad == trainable]
              for trainable in (True, False)]
    groups = [g for g in groups if g] or [[]]
    comm_policy = comm_policy or FlatCollectives()
    info = _mesh_info(group, replicate_group, secondary_group, all_group, mesh, ctx,
                      layout.exposes_dtensors and offload_policy.home(torch.device(device)))
    units = []
    for k, g in enumerate(groups):
        master_dtype = params[g[0]].dtype if g else torch.float32
        config = UnitConfig.make(STAGES[stage], mp_policy, master_dtype, layout, comm_policy,
                                 offload_policy, device)
        controls = Controls(reshard_after_forward=reshard_after_forward,
                            broadcast_buffers=broadcast_buffers and k == 0, prefetch=prefetch)
        units.append(Unit(modules, [params[i] for i in g], [locations[i] for i in g], config,
                          info, controls))
    originals = [[params[i] for i in g] for g in groups]
    unit = units[0]  # the trainable one, if any: the others follow it (Unit.sibling_of)
    for sibling in units[1:]:
        sibling.place_under(unit, sibling=True)
    for child in children:
        if child.parent is None:
            child.place_under(unit)
    for p in ignored_params or ():
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
    return module


def _shard_by_policy(model, stage, mesh, policy, strategy, kwargs):
    """FSDP1's one call: units where the policy says, bottom-up, then the root."""
    if isinstance(model, (list, tuple)):
        raise TypeError("auto_wrap_policy and sharding_strategy take one model, not a list")
    if strategy is not None:
        device = next(iter(model.parameters()), None)
        device_type = device.device.type if device is not None else "cpu"
        stage, mesh = wrap.stage_and_mesh(strategy, stage, mesh, dist.get_world_size(
            kwargs["group"]), device_type)
    stage = 3 if stage is None else stage
    if kwargs["reshard_after_forward"] is not None and stage != 3:
        kwargs["reshard_after_forward"] = None  # (the strategy decides: ZeRO-2 keeps them)
    if policy is not None:
        chosen = wrap.units_by_policy(model, policy, kwargs["ignored_params"])
        for module in chosen:
            # A tied parameter belongs to the lowest unit holding all its users (FSDP1 would
            # put it in the first unit wrapping one of them): leave it to a unit above.
            shard(module, stage=stage, mesh=mesh, _leave=wrap.shared_outside(model, module),
                  **kwargs)
    return shard(model, stage=stage, mesh=mesh, **kwargs)


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
    return shard, replicate, _mesh_group(mesh)


def _mesh_info(group, replicate_group, secondary_group, all_group, mesh, ctx, dtensors_on):
    """Who the unit talks to: its group, HSDP's replicas, hpZ's node (``zero/core/config.py``).
    DTensor parameters (layout "rows") are placed on the user's mesh, or on a 1-D one over
    the group, made here once for the unit (``dtensors_on``: the shards' device, else False)."""
    placement = mesh
    if mesh is None:
        placement = DeviceMesh.from_group(group or dist.group.WORLD, dtensors_on.type) \
            if dtensors_on else group
    post_forward = None if secondary_group is None else MeshInfo.over(secondary_group,
                                                                      context=ctx)
    if replicate_group is None:
        return MeshInfo.over(group, all_group, placement, post_forward, ctx)
    return HSDPMeshInfo.over(group, all_group, placement, post_forward, ctx,
                             replicate_group=replicate_group)


def _mesh_group(mesh):
    """The group of all of a mesh's ranks (the world, when the mesh spans it)."""
    if mesh.size() == dist.get_world_size():
        return None
    if not hasattr(mesh, "_zero_all_group"):
        mesh._zero_all_group = dist.new_group(sorted(mesh.mesh.flatten().tolist()))
    return mesh._zero_all_group


def _check(modules: list[nn.Module], stage: int, mp_policy, reshard_after_forward, ignored):
    """The local checks; returns the unit's parameters, their uses, and the units below."""
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3 (ZeRO's three stages), got {stage!r}")
    if reshard_after_forward is not None and stage != 3:
        raise ValueError("reshard_after_forward only applies to stage 3; leave it None")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise TypeError("mp_policy must be a zero.MixedPrecision or torch's "
                        "MixedPrecisionPolicy")
    for module in modules:
        if registry.unit_on(module) is not None:
            raise RuntimeError(
                f"{type(module).__name__} is already sharded; call zero.shard once per module")

    children = list({u: None for top in modules for m in top.modules() for u in units_on(m)})
    for child in children:
        if child.stage.number != stage:
            raise ValueError(
                f"{child.name} is a stage-{child.stage.number} unit but this call asks for "
                f"stage {stage}; use one stage for all units of a model")
    params, locations = _own_parameters(modules, children, ignored)
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        names = {str(d): [n for n, p in _names(modules, params) if p.dtype == d] for d in dtypes}
        raise ValueError(
            f"one unit needs one dtype, but {type(modules[0]).__name__}'s parameters have "
            f"{names}; cast the module (module.to(dtype)) or shard the differing sub-modules "
            "as their own units first")
    return params, locations, children


def _device(module: nn.Module, group, device) -> torch.device:
    found = next(iter([*module.parameters(), *module.buffers()]), None)
    if found is not None and found.device.type != "meta":
        if device is not None and torch.device(device) != found.device:
            raise ValueError(f"device={device} but the module is on {found.device}; move the "
                             "module first, or build it on the meta device")
        return found.device
    return torch.device(device) if device is not None else comm.default_device(group)


def _own_parameters(modules: list[nn.Module], children: list[Unit], ignored: set[int]):
    """The parameters this unit takes (not owned below, not ignored), each with every place
    it is used."""
    inside = {u: {id(m) for top in u.modules for m in top.modules()} for u in children}
    found: dict[int, tuple[nn.Parameter, list]] = {}
    for top in modules:
        for mod_name, mod in top.named_modules():
            for attr, p in mod._parameters.items():
                if p is None or id(p) in ignored or registry.is_ignored(p):
                    continue
                owner = registry.unit_of(p)
                if registry.replaced_by(p) is not None:  # tied to a unit's original
                    raise _shared_error(f"{mod_name}.{attr}", registry.replaced_by(p))
                if owner is None:
                    found.setdefault(id(p), (p, []))[1].append((mod, attr))
                elif owner not in inside:
                    raise RuntimeError(
                        f"'{mod_name}.{attr}' already belongs to a unit above "
                        f"{type(top).__name__}: zero.shard was called on a parent before this "
                        "child. Shard bottom-up: children first, then their parents")
                elif id(mod) not in inside[owner]:
                    raise _shared_error(f"{mod_name}.{attr}", owner)
    params = [p for p, _ in found.values()]
    return params, [locs for _, locs in found.values()]


def _shared_error(name: str, owner: Unit) -> ValueError:
    return ValueError(
        f"parameter '{name}' is shared with the unit {owner.name}, which "
        "does not contain this use of it. A shared (tied) parameter must live in one unit: "
        "do not shard a module holding only some of its users; shard a common parent instead")


def _names(modules: list[nn.Module], params):
    ids = {id(p) for p in params}
    prefix = len(modules) > 1  # "0.weight", "1.weight": which module of the list
    return [(f"{i}.{n}" if prefix else n, p) for i, m in enumerate(modules)
            for n, p in m.named_parameters() if id(p) in ids]


# ---- model-level helpers -----------------------------------------------------------------------


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients over micro-batches without communication (like DDP's ``no_sync``).

    Inside, backward leaves each unit's full flat gradient in place (full-size, as in DDP);
    the first backward outside reduces everything accumulated. As with DDP,
    ``optimizer.zero_grad()`` (or ``model.zero_grad()``) in between discards what was
    accumulated.
    """
    units = units_of(model)
    before = [u.controls.requires_grad_sync for u in units]
    for u in units:
        u.controls.requires_grad_sync = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u.controls.requires_grad_sync = b
