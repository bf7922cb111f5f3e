"""Checkpoints: sharded save and load on ``torch.distributed.checkpoint`` (DCP), in FSDP2's layout.

    zero.save("ckpt", model, opt)     # every rank writes its own chunks, in parallel
    zero.load("ckpt", model, opt)     # at any world size, into any stage
    python -m zero export ckpt model.pt   # one file for nn.Module.load_state_dict

What goes to disk is what an FSDP2 user writes with ``dcp.save({"model": msd, "optim": osd})``
after ``msd, osd = get_state_dict(model, opt)``: one entry per original parameter, by name and
full shape, each rank holding FSDP2's dim-0 chunk of it (``zero/checkpoint/fsdp2_layout.py``); the optimizer
state likewise, and its param groups by parameter name. Nothing in it depends on our flat
layout, the world size or the stage, so DCP reshards on load by reading whichever bytes
overlap each rank's chunk, and FSDP2 reads our checkpoints and we read theirs
(notes/07-checkpoints.md: why, and what it costs). Conversion goes one unit at a time.

Writes are atomic: a crash during ``save`` leaves the previous checkpoint loadable
(``zero/checkpoint/directory.py``). Reads run no code: a checkpoint is data, whoever made it
(``zero/checkpoint/safe_pickle.py``); and before a byte is read every rank checks the checkpoint and the
ranks agree on the outcome, so a bad one raises on every rank and none hangs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from zero import comm, torch_hooks
from zero.checkpoint import directory as ckdir
from zero.checkpoint import reader, safe_pickle
from zero.checkpoint.fsdp2_layout import (chunk_of, chunks_to_flat, flat_to_chunks, mesh_of,
                                          to_dtensor)
from zero.core import registry
from zero.core.registry import units_of


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Save ``model`` (and ``optimizer``) as a new version under ``path``; call on every rank.

    Args:
        path: the checkpoint directory, on a file system every rank sees.
        model: a model sharded with ``zero.shard`` (any stage).
        optimizer: its optimizer, or None for the parameters only.

    Returns:
        The DCP directory written (``path/v000003``); ``path/latest`` now points at it.
    """
    units = units_of(model)
    comm.agree(f"save a checkpoint in {path}", group=units[0].all_group,
               fix="Call zero.save on every rank, with the same path: every rank writes its "
                   "own chunks")
    state = state_dict(model, optimizer)
    version = _on_rank0("pick a version directory", ckdir.next_version, path)
    dcp.save(state, storage_writer=FileSystemWriter(os.path.join(path, version)))
    _on_rank0("point 'latest' at the new checkpoint", ckdir.commit, path, version)
    return os.path.join(path, version)


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """What ``save`` writes: ``{"model": ..., "optim": ...}`` as FSDP2's ``get_state_dict`` returns.

    Collective (one all-gather per unit and tensor kind); every rank gets its own chunks.
    """
    units = units_of(model)
    state = {"model": _model_state(model, units)}
    if optimizer is not None:
        state["optim"] = _optim_state(model, optimizer, units)
    return state


def _entries(model: nn.Module) -> dict:
    """The model's state-dict entries as they are (our pieces, buffers), under every name."""
    with torch_hooks.state_dict_access():
        return model.state_dict(keep_vars=True)


def _model_state(model: nn.Module, units) -> dict:
    """FSDP2's model state dict: a Shard(0) DTensor per parameter, buffers as they are."""
    chunks = {}
    for unit in units:
        mesh = mesh_of(unit.group, unit.sharded.device)
        for i, t in enumerate(flat_to_chunks(unit, unit.sharded)):
            chunks[unit, i] = to_dtensor(t, unit.layout.shapes[i], mesh)
    return {name: chunks[registry.unit_of(t), registry.index_of(t)] if registry.is_piece(t)
            else t.detach()
            for name, t in _entries(model).items()}  # tied: every name, as FSDP2


def _optim_state(model: nn.Module, optimizer, units) -> dict:
    """FSDP2's optimizer state dict: state and param groups keyed by parameter name."""
    names = _first_names(model)
    saved = optimizer.state_dict()  # keyed by position in the param groups
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {names[params[i]]: dict(s) for i, s in saved["state"].items()}
    for unit in units:
        mesh = mesh_of(unit.group, unit.sharded.device)
        for key, holders in _elementwise(unit, optimizer).items():
            shard = unit.sharded.new_zeros(unit.layout.shard_numel)  # laid out like the params
            for i in holders:
                unit.piece(shard, i).copy_(optimizer.state[unit.params[i]][key])
            chunks = flat_to_chunks(unit, shard)
            for i in holders:
                state[names[unit.params[i]]][key] = to_dtensor(chunks[i], unit.layout.shapes[i], mesh)
    groups = [{**g, "params": [names[params[i]] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def _elementwise(unit, optimizer) -> dict[str, list[int]]:
    """Optimizer state keys shaped like the parameter's piece (exp_avg, not step): which params."""
    found: dict[str, list[int]] = {}
    for i, p in enumerate(unit.params):
        for key, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape:
                found.setdefault(key, []).append(i)
    return dict(sorted(found.items()))  # the same order on every rank


def _first_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}  # a tied parameter: its first name


def _on_rank0(what: str, fn: Callable, *args):
    """Run ``fn`` on rank 0; every rank returns its result or raises its error (never hangs)."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 (reported on every rank below)
            outcome = (False, f"{type(e).__name__}: {e}")
    ok, value = comm.all_gather_object(outcome)[0]
    if not ok:
        raise RuntimeError(f"rank 0 could not {what} in the checkpoint directory: {value}")
    return value


# ---- load ----------------------------------------------------------------------------------


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Load a checkpoint into ``model`` (and ``optimizer``); call on every rank.

    Args:
        path: a ``zero.save`` directory (its ``latest`` is read) or any DCP checkpoint in
            FSDP2's layout (``dcp.save({"model": ..., "optim": ...})``), saved at any world
            size and stage.
        model: the same model, sharded with ``zero.shard``.
        optimizer: an optimizer built on ``model.parameters()``, with or without state yet;
            its state and param-group options are replaced by the checkpoint's.

    Returns:
        The DCP directory read.

    Raises (on every rank, whichever rank found it):
        FileNotFoundError: no checkpoint at ``path``.
        UntrustedCheckpointError: it holds a pickle that would run code (it was not run).
        RuntimeError: the checkpoint is corrupt or truncated (names the keys affected), or
            the ranks read different checkpoints.
        ValueError: it was saved from another model (names the keys and shapes that differ).
    """
    units, names = units_of(model), _first_names(model)
    entries = _entries(model)  # the names to fill: tied ones, buffers too
    shapes = {k: registry.unit_of(t).layout.shapes[registry.index_of(t)] if registry.is_piece(t)
              else t.shape
              for k, t in entries.items()}
    ckpt, meta, elementwise = _agreed(path, _checked, path, shapes, optimizer is not None)
    template, chunks = _templates(meta, units, names, entries, elementwise, optimizer is not None)
    reader.read(template, ckpt, meta)

    with torch.no_grad():
        for unit in units:
            shard = chunks_to_flat(unit, [_local(c) for c in chunks[unit]])
            unit.wait_unshard()  # stages 1/2: a gather of the old shard must not land after this
            unit.sharded.copy_(shard)
            unit.shard_changed()  # stages 1/2 re-gather their full parameters, stage 3 drops them
        for k, t in entries.items():
            if not registry.is_piece(t):
                t.copy_(template["model"][k])  # buffers and unsharded parameters: whole
    if optimizer is not None:
        _load_optim(optimizer, units, names, template["optim"], elementwise)
    return ckpt


def _checked(path: str, shapes: dict, with_optim: bool):
    """Every check before the first byte is read, on this rank alone (no collective)."""
    ckpt = ckdir.resolve(path)
    meta, fingerprint = ckdir.read_metadata(ckpt)
    return (ckpt, meta, ckdir.check_fits(ckpt, meta, shapes, with_optim)), fingerprint


_ERRORS = {e.__name__: e for e in (FileNotFoundError, ValueError, RuntimeError,
                                   safe_pickle.UntrustedCheckpointError)}


def _agreed(path: str, checks: Callable, *args):
    """Run ``checks`` on every rank, then agree, in one small all-gather, before any collective
    that moves data: every rank returns, or every rank raises (its own error, or else the first
    failing rank's). Ranks can see different files: a node-local disk, an unfinished copy."""
    mine, fingerprint = None, None
    try:
        value, fingerprint = checks(*args)
    except Exception as e:  # noqa: BLE001 (reported on every rank below)
        mine = e
    error = None if mine is None else (type(mine).__name__, str(mine))
    told = comm.all_gather_object((error, fingerprint))
    if mine is not None:
        raise mine
    if failed := [(r, error) for r, (error, _) in enumerate(told) if error]:
        rank, (kind, message) = failed[0]
        raise _ERRORS.get(kind, RuntimeError)(f"rank {rank} cannot load {path}: {message}")
    if len({f for _, f in told}) > 1:
        raise RuntimeError(
            f"the ranks read different checkpoints at {path} (their .metadata differ): every "
            "rank must see the same, complete checkpoint; put it on a file system they share, "
            "and load it once it is fully written or copied")
    return value


def _templates(meta, units, names, entries, elementwise, with_optim: bool):
    """What DCP loads into: this rank's FSDP2 chunk of each parameter and elementwise state
    (so it reads only the bytes that overlap it), everything else whole."""
    device = units[0].sharded.device
    template = ckdir.plain_template(meta, {"model", "optim"} if with_optim else {"model"}, device)
    chunks = {}
    for unit in units:
        mesh = mesh_of(unit.group, device)
        chunks[unit] = []
        for p, shape in zip(unit.params, unit.layout.shapes):
            mine = chunk_of(shape, unit.world_size, unit.rank).shape
            chunks[unit].append(to_dtensor(unit.sharded.new_empty(mine), shape, mesh))
            state = template["optim"].get("state", {}).get(names[p], {}) if with_optim else {}
            for key in elementwise.get(names[p], ()):
                state[key] = to_dtensor(state[key].new_empty(mine), shape, mesh)
    for k, t in entries.items():
        if registry.is_piece(t):
            template["model"][k] = chunks[registry.unit_of(t)][registry.index_of(t)]
    return template, chunks


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _load_optim(optimizer, units, names, saved: dict, elementwise: dict) -> None:
    """Rebuild torch's positional optimizer state dict for our pieces, then load it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    saved.setdefault("state", {})  # saved before the first step: param groups only
    state = {}
    for p in params:
        if names[p] in saved["state"]:
            state[index[p]] = {k: v for k, v in saved["state"][names[p]].items()
                               if k not in elementwise.get(names[p], ())}
    for unit in units:
        keys = sorted({k for p in unit.params for k in elementwise.get(names[p], ())})
        for key in keys:  # one all-gather per unit and state key, like saving
            owned = [key in elementwise.get(names[p], ()) for p in unit.params]
            got = [_local(saved["state"][names[p]][key]) if o else None
                   for p, o in zip(unit.params, owned)]
            shard = chunks_to_flat(unit, got)
            for i, p in enumerate(unit.params):
                if owned[i] and p in index:
                    state[index[p]][key] = unit.piece(shard, i).clone()
    groups = []
    for g in optimizer.param_groups:
        mine = [names[p] for p in g["params"]]
        match = [s for s in saved["param_groups"] if set(s["params"]) == set(mine)]
        if not match:
            raise ValueError(
                f"no parameter group in the checkpoint holds exactly {mine}; its groups hold "
                f"{[s['params'] for s in saved['param_groups']]}. Build the optimizer with the "
                "same parameter groups as the one that was saved")
        if set(match[0]) != set(g):
            raise ValueError(
                f"the checkpoint's optimizer has options {sorted(set(match[0]) - set(g))} that "
                f"this one lacks, and lacks {sorted(set(g) - set(match[0]))}: it was another "
                "optimizer class. Build the same class as was saved")
        groups.append({**match[0], "params": [index[p] for p in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- export: one plain file (DeepSpeed's zero_to_fp32) -------------------------------------


def export(path: str, out_file: str) -> dict[str, torch.Tensor]:
    """Consolidate a checkpoint's model into one ``torch.save`` file of ``{name: full tensor}``.

    Runs in one process, without a process group, and holds the whole model in memory (that is
    the point). Reads run no code, like ``load``; the file written holds only tensors (and
    plain values), so it loads with ``torch.load(out_file, weights_only=True)``, and a plain
    unsharded model loads it with ``load_state_dict``.
    """
    ckpt = ckdir.resolve(path)
    meta, _ = ckdir.read_metadata(ckpt)
    ckdir.check_has_model(ckpt, meta)
    ckdir.check_files(ckpt, meta)
    template = ckdir.plain_template(meta, {"model"}, "cpu")
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        reader.read(template, ckpt, meta, no_dist=True)
    state = template["model"]
    tmp = f"{out_file}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out_file)  # atomic, like the checkpoint itself
    return state
