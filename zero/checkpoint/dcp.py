"""Checkpoints: sharded save on ``torch.distributed.checkpoint`` (DCP), in FSDP2's layout.

    zero.save("ckpt", model, opt)     # every rank writes its own chunks, in parallel
    zero.load("ckpt", model, opt)     # at any world size, into any stage (loading.py)
    python -m zero export ckpt model.pt   # one file for nn.Module.load_state_dict

On disk is what FSDP2's ``dcp.save`` of ``get_state_dict`` writes (``fsdp2_layout.py``), converted
one unit at a time. What that is, why, what it costs, and how versions (``directory.py``) and
reads (``reader.py``) stay safe: notes/08-checkpoints.md, from "What is on disk".
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from zero import comm
from zero.comm.context import CommContext
from zero.checkpoint import reader
from zero.checkpoint import directory as ckdir
from zero.checkpoint.fsdp2_layout import flat_to_chunks, mesh_of, to_dtensor
from zero.core import adoption, placement, registry
from zero.core.guards import state_dict_access
from zero.core.registry import units_of
from zero.core.rows import local_tensor


# zero's checkpoints hold dim-0 rows of whole parameters; a TP or Shard(d) one is not (placement.py)
PLACED_FIX = ("save and load it through torch's DCP state-dict functions, as on FSDP2: "
              "dcp.save({'model': get_model_state_dict(model), 'optim': "
              "get_optimizer_state_dict(model, optimizer)}, checkpoint_id=...), and "
              "set_model_state_dict / set_optimizer_state_dict after dcp.load")


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         keep: int = 1) -> str:
    """Save ``model`` (and ``optimizer``) as a new version under ``path``; call on every rank.

    Args:
        path: the checkpoint directory, seen by every rank; one job at a time saves into it.
        model: a model sharded with ``zero.shard`` (any stage).
        optimizer: its optimizer, or None for the parameters only.
        keep: how many complete versions to keep, the new one included (keep-last-K); older
            ones ``save`` made go once ``latest`` names the new one, nothing else in ``path``.

    Returns:
        The DCP directory written (``path/v000003``); ``path/latest`` now points at it.
    """
    units = units_of(model)
    group, ctx = units[0].all_group, units[0].root.context
    with comm.raising_together(group, ctx=ctx):
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep={keep!r}: keep is how many versions stay, 1 or more")
        check_optimizer(model, optimizer)
    adoption.adopt_agreed(units, f"save a checkpoint in {path}, keeping {keep}",
                          fix="Call zero.save on every rank, with the same path: every rank "
                              "writes its own chunks")
    state = state_dict(model, optimizer)
    lock: list[int] = []  # rank 0's hold on the directory while it saves

    def begin() -> str:
        lock.append(ckdir.lock(path))
        return ckdir.next_version(path)

    try:
        version = _on_rank0(ctx, "start a new version", begin)
        try:
            _write(state, path, version)
            _on_rank0(ctx, "point 'latest' at the new checkpoint", ckdir.commit, path, version,
                      keep)
        except BaseException:
            if lock:  # rank 0: a failed save leaves nothing behind
                ckdir.discard(path, version)
            raise
    finally:
        if lock:
            ckdir.unlock(path, lock[0])
    return os.path.join(path, version)


def _write(state: dict, path: str, version: str) -> None:
    """``dcp.save`` into ``path/version``; its failure (DCP gathers every rank's) as one error."""
    try:
        dcp.save(state, storage_writer=FileSystemWriter(os.path.join(path, version)))
    except CheckpointException as e:  # (a BaseException)
        lines = [f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in e.failures.items()]
        raise RuntimeError(f"saving {version} in {path} failed, on every rank (it is deleted; "
                           "'latest' still names the previous version): " + "; ".join(lines)) from None


def check_optimizer(model: nn.Module, optimizer) -> None:
    """Every parameter ``optimizer`` holds is one of ``model``'s (saved and loaded by name)."""
    if optimizer is None:
        return
    names = first_names(model)
    for p in (p for g in optimizer.param_groups for p in g["params"] if p not in names):
        if registry.replaced_by(p) is not None:
            raise ValueError(
                f"{type(optimizer).__name__} holds a parameter that zero.shard replaced by its "
                "shard: the optimizer was built before sharding. Build it after zero.shard, "
                "from model.parameters()")
        raise ValueError(
            f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} that is not "
            "one of the model's: a checkpoint keeps optimizer state by the model's parameter "
            "names. Build the optimizer on model.parameters()")


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """What ``save`` writes: ``{"model": ..., "optim": ...}`` as FSDP2's ``get_state_dict`` returns
    (collective: one all-gather per unit and tensor kind)."""
    units = units_of(model)
    placement.refuse(units, "zero.save", PLACED_FIX, any_dim=True)
    state = {"model": _model_state(model, units)}
    if optimizer is not None:
        with resident(optimizer):  # (DiskOffload: the state back from its files)
            state["optim"] = _optim_state(model, optimizer, units)
    return state


def entries_of(model: nn.Module) -> dict:
    """The model's state-dict entries (our pieces, buffers), under every name. Its state-dict
    hooks see each parameter in its full shape (a meta stand-in for a 1-D piece); a hook that
    makes new tensors of them (torchtitan's fused-QKV split) is refused."""
    units = units_of(model)
    stand_in = {}  # id(stand-in) -> the piece it stands for
    for unit in units:
        shown = [torch.empty(shape, dtype=p.dtype, device="meta") if type(p.data) is torch.Tensor
                 else p for p, shape in zip(unit.params, unit.layout.shapes)]  # (DTensor: as is)
        stand_in.update({id(t): p for t, p in zip(shown, unit.params) if t is not p})
        unit.use(shown)
    try:
        with state_dict_access():
            entries = model.state_dict(keep_vars=True)
    finally:
        for unit in units:
            unit.use_sharded_params()
    known = {id(t) for t in [*model.parameters(), *model.buffers()]}
    made = [k for k, t in entries.items()
            if id(t) not in stand_in and torch.is_tensor(t) and id(t) not in known]
    if made:
        raise ValueError(
            f"a state-dict hook of the model makes {made[0]!r} out of its parameters (a fused "
            "parameter split for saving, say): zero.save and zero.load move each parameter "
            "as the model holds it, so the hook's tensor would be saved, or loaded, in "
            "vain. Shard with layout='rows' (zero.fully_shard) and save with torch's DCP "
            "state-dict functions (or torchtitan's CheckpointManager), which run the hook")
    return {key: stand_in.get(id(t), t) for key, t in entries.items()}


def _model_state(model: nn.Module, units) -> dict:
    """FSDP2's model state dict: a Shard(0) DTensor per parameter, buffers as they are."""
    chunks = {}
    for unit in units:
        mesh = mesh_of(unit)
        for i, t in enumerate(flat_to_chunks(unit, unit.sharded)):
            chunks[unit, i] = to_dtensor(t, unit.layout.shapes[i], mesh)
    return {name: chunks[registry.unit_of(t), registry.index_of(t)] if registry.is_piece(t)
            else t.detach()
            for name, t in entries_of(model).items()}  # tied: every name, as FSDP2


@contextlib.contextmanager
def resident(optimizer):
    """All of ``optimizer``'s state in memory for the duration (asked of each offload policy)."""
    policies: dict = {}  # policy -> its units, in the optimizer's order
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = registry.unit_of(p)
            if unit is not None:
                policies.setdefault(unit.offload, {})[unit] = None
    with contextlib.ExitStack() as stack:
        for policy, units in policies.items():
            stack.enter_context(policy.resident(optimizer, list(units)))
        yield


def _optim_state(model: nn.Module, optimizer, units) -> dict:
    """FSDP2's optimizer state dict: state and param groups keyed by parameter name."""
    names = first_names(model)
    with state_dict_access():  # (refused to users: zero/surface/attach.py)
        saved = optimizer.state_dict()  # keyed by position in the param groups
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {names[params[i]]: dict(s) for i, s in saved["state"].items()}
    for unit in units:
        mesh = mesh_of(unit)
        for key, holders in _elementwise(unit, optimizer).items():
            shard = unit.sharded.new_zeros(unit.layout.shard_numel)  # laid out like the params
            for i in holders:
                if (value := optimizer.state.get(unit.params[i], {}).get(key)) is not None:
                    unit.piece(shard, i).copy_(local_tensor(value).reshape(-1))
            chunks = flat_to_chunks(unit, shard)
            for i in holders:  # (layout "whole": state on the owner only; every rank saves it)
                state.setdefault(names[unit.params[i]], {})[key] = to_dtensor(
                    chunks[i], unit.layout.shapes[i], mesh)
    groups = [{**g, "params": [names[params[i]] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def _elementwise(unit, optimizer) -> dict[str, list[int]]:
    """{state key shaped like the piece (exp_avg, not step): params}, merged over the ranks."""
    found: dict[str, list[int]] = {}
    for i, p in enumerate(unit.params):
        for key, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape:
                found.setdefault(key, []).append(i)
    if not unit.layout.empty_pieces_get_grads:
        merged: dict[str, set] = {}
        for theirs in comm.all_gather_object(found, group=unit.group, ctx=unit.root.context):
            for key, holders in theirs.items():
                merged.setdefault(key, set()).update(holders)
        found = {key: sorted(holders) for key, holders in merged.items()}
    return dict(sorted(found.items()))  # the same order on every rank


def first_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}  # a tied parameter: its first name


def _on_rank0(ctx: CommContext, what: str, fn: Callable, *args):
    """Run ``fn`` on rank 0; every rank returns its result or raises its error (never hangs)."""
    outcome = None
    if ctx.rank() == 0:
        try:
            outcome = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 (reported on every rank below)
            outcome = (False, f"{type(e).__name__}: {e}")
    ok, value = comm.all_gather_object(outcome, ctx=ctx)[0]
    if not ok:
        raise RuntimeError(f"rank 0 could not {what} in the checkpoint directory: {value}")
    return value


# ---- export: one plain file (DeepSpeed's zero_to_fp32) -------------------------------------


def export(path: str, out_file: str) -> dict[str, torch.Tensor]:
    """Consolidate a checkpoint's model into one ``torch.save`` file of ``{name: full tensor}``
    (one process, the whole model in memory, read as ``load`` reads: notes/08, "Export")."""
    ckpt = ckdir.resolve(path)
    ckdir.check_out_file(out_file, path, ckpt)
    state = reader.read_model(ckpt)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(out_file) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(out_file)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, out_file)  # (once complete: a failure removes the temporary file)
    except BaseException:
        os.remove(tmp)
        raise
    return state

