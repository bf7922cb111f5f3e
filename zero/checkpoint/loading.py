"""``zero.load``: a checkpoint in FSDP2's layout into our shards, one unit at a time.

    zero.load("ckpt", model, opt)     # at any world size, into any stage, or FSDP2's checkpoint

Every rank checks everything alone, then all agree (``_agreed``); the small things load whole;
each unit's chunks go through ``chunks_to_flat``, so no rank holds more than its shards and one
unit. notes/08-checkpoints.md, "Moving one unit" and "Loading what is not there".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from zero import comm
from zero.comm.context import CommContext
from zero.checkpoint import reader, validate, safe_pickle
from zero.checkpoint import directory as ckdir
from zero.checkpoint.dcp import PLACED_FIX, check_optimizer, entries_of, first_names, resident
from zero.checkpoint.fsdp2_layout import chunk_of, chunks_to_flat, mesh_of, to_dtensor
from zero.core import adoption, placement, registry
from zero.core.guards import state_dict_access
from zero.core.registry import units_of
from zero.core.rows import local_tensor


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Load a checkpoint into ``model`` (and ``optimizer``); call on every rank.

    Args:
        path: a ``zero.save`` directory (its ``latest`` is read, once) or any DCP checkpoint
            in FSDP2's layout (``dcp.save({"model": ..., "optim": ...})``), saved at any
            world size and stage.
        model: the same model, sharded with ``zero.shard``.
        optimizer: an optimizer built on ``model.parameters()``, with or without state yet;
            its state and param-group options are replaced by the checkpoint's.

    Returns:
        The DCP directory read (``path/v000003``).

    Raises (on every rank, whichever rank found it):
        FileNotFoundError: no checkpoint at ``path``, or its version deleted as it was read.
        UntrustedCheckpointError: it holds a pickle that would run code (it was not run).
        RuntimeError: corrupt or truncated (naming the keys), or the ranks read different ones.
        ValueError: another model's (naming keys and shapes), or an optimizer not the model's.
    """
    units = units_of(model)
    placement.refuse(units, "zero.load", PLACED_FIX, any_dim=True)
    # (before entries_of puts its tensors in the slots: a replacement not adopted is dropped)
    adoption.adopt_agreed(units, "load a checkpoint", fix="Call zero.load on every rank")
    names, entries = first_names(model), entries_of(model)
    ctx, with_optim = units[0].root.context, optimizer is not None
    found, meta, elementwise = _agreed(ctx, path, _checked, path, model, optimizer, entries)
    try:
        rest = _rest(meta, entries, elementwise, with_optim)
        reader.read(rest, found)
        if with_optim:
            groups = _groups(optimizer, names, _checked_optim(found.ckpt, rest["optim"]))
        with torch.no_grad():
            state = _load_units(found, meta, units, names, entries, elementwise)
            _raise_together(ctx, found.ckpt, state.pop(None, None))
            for k, t in entries.items():
                if not registry.is_piece(t):
                    t.copy_(rest["model"][k])  # buffers and unsharded parameters: whole
    finally:
        found.close()
    if with_optim:
        _load_optim(optimizer, names, rest["optim"]["state"], state, elementwise, groups)
    return found.ckpt


def _checked(path: str, model, optimizer, entries):
    """Every check before the first byte is loaded, on this rank alone (no collective)."""
    check_optimizer(model, optimizer)
    shapes = {k: registry.unit_of(t).layout.shapes[registry.index_of(t)] if registry.is_piece(t)
              else t.shape for k, t in entries.items()}
    ckpt = ckdir.resolve(path)
    meta, fingerprint = validate.read_metadata(ckpt)
    elementwise = validate.check_fits(ckpt, meta, shapes, optimizer is not None)
    # (an ignored parameter is whole on every rank: so is its state, loaded with the rest)
    elementwise = {n: ks for n, ks in elementwise.items() if registry.is_piece(entries[n])}
    found = reader.Reader(ckpt, meta)
    try:
        found.prepare(_records(meta, _boxes(entries, elementwise, meta, optimizer)))
    except BaseException:
        found.close()
        raise
    return (found, meta, elementwise), fingerprint


def _boxes(entries, elementwise, meta, optimizer) -> dict:
    """``{checkpoint key: (first row, end row) this rank loads, or None: all of it}``."""
    boxes = {f"model.{k}": _rows(t) if registry.is_piece(t) else None for k, t in entries.items()}
    if optimizer is not None:
        for key, path in meta.planner_data.items():
            if path[0] == "optim":
                boxes[key] = _rows(entries[path[2]]) if _sharded(path, elementwise) else None
    return boxes


def _sharded(path: tuple, elementwise: dict) -> bool:
    """Whether ``path`` is elementwise optimizer state (exp_avg, not step): loaded by unit."""
    return len(path) == 4 and path[1] == "state" and path[3] in elementwise.get(path[2], ())


def _rows(piece) -> tuple[int, int] | None:
    """This rank's FSDP2 chunk of the parameter ``piece`` belongs to, as rows (0-d: None)."""
    unit = registry.unit_of(piece)
    shape = unit.layout.shapes[registry.index_of(piece)]
    return chunk_of(shape, unit.world_size, unit.rank).rows


def _records(meta, boxes: dict) -> list:
    """The storage_data keys of every stored chunk that overlaps what this rank loads."""
    found = []
    for key, rows in boxes.items():
        md = meta.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            found += [MetadataIndex(key, c.offsets) for c in md.chunks if rows is None
                      or (c.offsets[0] < rows[1] and rows[0] < c.offsets[0] + c.sizes[0])]
        else:
            found.append(MetadataIndex(key))
    return found


_ERRORS = {e.__name__: e for e in (FileNotFoundError, ValueError, RuntimeError,
                                   safe_pickle.UntrustedCheckpointError)}


def _agreed(ctx: CommContext, path: str, checks: Callable, *args):
    """``checks(*args)``, then one small all-gather: every rank returns, or every rank raises
    (its own error, else the first failing rank's): ranks can see different files."""
    mine = fingerprint = value = None
    try:
        value, fingerprint = checks(*args)
    except Exception as e:  # noqa: BLE001 (reported on every rank below)
        mine = e
    error = None if mine is None else (type(mine).__name__, str(mine))
    told = comm.all_gather_object((error, fingerprint), ctx=ctx)
    if mine is not None:
        raise mine
    failed = [(r, error) for r, (error, _) in enumerate(told) if error]
    differ = len({f for _, f in told}) > 1
    if failed or differ:
        assert value is not None  # (this rank's checks passed: it holds what they opened)
        value[0].close()
    if failed:
        rank, (kind, message) = failed[0]
        raise _ERRORS.get(kind, RuntimeError)(f"rank {rank} cannot load {path}: {message}")
    if differ:
        raise RuntimeError(
            f"the ranks read different checkpoints at {path} (their .metadata differ): every "
            "rank must see the same, complete checkpoint: put it on a file system they share, "
            "load it once it is fully written or copied, and if a save into it moved 'latest' "
            "between the ranks' reads, load again")
    return value


def _rest(meta, entries, elementwise, with_optim: bool) -> dict:
    """The template of what loads whole: buffers, unsharded params, non-elementwise optim."""
    def wanted(path: tuple) -> bool:
        if path[0] == "model":
            return not registry.is_piece(entries[path[1]])
        return with_optim and path[0] == "optim" and not _sharded(path, elementwise)

    return reader.template(meta, wanted, {"model": {}, "optim": {"state": {}}})


def _load_units(found, meta, units, names, entries, elementwise: dict) -> dict:
    """Each unit's shard, then its state key by key: ``{param: {key: piece}}``, None: a failure."""
    aliases: dict = {}  # every name of each piece (tied parameters have several)
    for k, t in entries.items():
        if registry.is_piece(t):
            aliases.setdefault(t, []).append(k)
    state: dict = {}
    # (names.get: a piece no module holds, a tie made after sharding, has no name, no state)
    for unit in units:
        keys = sorted({k for p in unit.params for k in elementwise.get(names.get(p), ())})
        shard = _read_unit(found, meta, unit, lambda p: [("model", k) for k in aliases.get(p, ())],
                           state)
        unit.wait_unshard()  # stages 1/2: a gather of the old shard must not land after this
        unit.sharded.copy_(shard)
        unit.shard_changed()  # stages 1/2 re-gather their full parameters, stage 3 drops them
        del shard
        for key in keys:  # one read and one all-gather per unit and state key, like saving
            owns = lambda p: key in elementwise.get(names.get(p), ())  # noqa: E731
            shard = _read_unit(found, meta, unit, lambda p: [("optim", "state", names[p], key)]
                               if owns(p) else [], state)
            for i, p in enumerate(unit.params):
                if owns(p):  # (shown as the parameter is: a DTensor for layout "rows")
                    state.setdefault(p, {})[key] = unit.exposed_piece(shard, i)
    return state


def _read_unit(found, meta, unit, paths, state: dict) -> torch.Tensor:
    """(S,) this rank's shard of what ``paths(param)`` name: its verified chunks, read alone."""
    mesh = mesh_of(unit)
    template: dict = {}
    chunks: list = []
    for p, shape in zip(unit.params, unit.layout.shapes):
        where = paths(p)
        chunks.append(None)
        if where:
            md = meta.state_dict_metadata[".".join(map(str, where[0]))]
            dtype = unit.sharded.dtype if where[0][0] == "model" else md.properties.dtype
            mine = chunk_of(shape, unit.world_size, unit.rank).shape
            chunks[-1] = to_dtensor(unit.sharded.new_empty(mine, dtype=dtype), shape, mesh)
        for path in where:  # (a tied parameter: under each of its names)
            set_element(template, path, chunks[-1])
    if template and None not in state:
        try:
            reader.read(template, found, alone=True)
        except Exception as e:  # noqa: BLE001 (told to every rank once all units are done)
            state[None] = f"{type(e).__name__}: {e}"
    return chunks_to_flat(unit, [local_tensor(c) if c is not None else None for c in chunks])


def _raise_together(ctx: CommContext, ckpt: str, failure: str | None) -> None:
    """After the units, every rank raises if one rank's read failed (a disk's read error)."""
    told = comm.all_gather_object(failure, ctx=ctx)
    if failed := [(r, f) for r, f in enumerate(told) if f]:
        raise RuntimeError(f"rank {failed[0][0]} could not read {ckpt} after checking it "
                           f"({failed[0][1]}); the model is partly loaded: load again")


def _checked_optim(ckpt: str, saved: dict) -> list:
    """The loaded param groups, refused unless each is a dict with ``params`` a list of names."""
    groups: Any = saved.get("param_groups")
    problems = [f"its param_groups are a {type(groups).__name__}, not a list of groups"]
    if isinstance(groups, list) and groups:
        problems = [f"param group {i} is a {type(g).__name__}, not a dict"
                    if not isinstance(g, dict)
                    else f"param group {i}'s params are not a list of parameter names"
                    for i, g in enumerate(groups)
                    if not isinstance(g, dict) or not isinstance(g.get("params"), list)
                    or not all(isinstance(n, str) for n in g["params"])]
    if problems:
        raise RuntimeError(f"checkpoint {ckpt} is corrupt: its optimizer's {problems[0]}; load "
                           "an earlier checkpoint")
    return groups


def _groups(optimizer, names, saved_groups) -> list:
    """Our param groups, each with the checkpoint's options of the group of the same params."""
    index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    groups = []
    for g in optimizer.param_groups:
        mine = [names[p] for p in g["params"]]
        match = [s for s in saved_groups if set(s["params"]) == set(mine)]
        if not match:
            raise ValueError(
                f"no parameter group in the checkpoint holds exactly {mine}; its groups hold "
                f"{[s['params'] for s in saved_groups]}. Build the optimizer with the "
                "same parameter groups as the one that was saved")
        if set(match[0]) != set(g):
            raise ValueError(
                f"the checkpoint's optimizer has options {sorted(set(match[0]) - set(g))} that "
                f"this one lacks, and lacks {sorted(set(g) - set(match[0]))}: it was another "
                "optimizer class. Build the same class as was saved")
        groups.append({**match[0], "params": [index[p] for p in g["params"]]})
    return groups


def _load_optim(optimizer, names, saved_state: dict, pieces: dict, elementwise, groups) -> None:
    """torch's positional optimizer state dict for our pieces, loaded in one call."""
    state = {}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        kept = {k: v for k, v in saved_state.get(names[p], {}).items()
                if k not in elementwise.get(names[p], ())}
        if kept or p in pieces:
            state[i] = {**kept, **pieces.get(p, {})}
    with state_dict_access(), resident(optimizer):
        # (refused to users: zero/surface/attach.py; DiskOffload: then written to its files)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
