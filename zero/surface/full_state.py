"""The model's state whole, in and out: ``zero.full_state_dict`` and ``zero.load_full_state_dict``.

Both put full-size tensors where the modules use their parameters and let torch's own
``state_dict`` / ``load_state_dict`` do the rest, so the keys are exactly the unsharded model's
(FSDP2's ``get_model_state_dict(..., full_state_dict=True)``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from zero import comm
from zero.core import adoption, placement, same_model
from zero.core.guards import state_dict_access
from zero.core.registry import is_piece, units_of


# A tensor-parallel parameter's shards are of its tp-local tensor, not of the whole one.
TP_FIX = ("use torch's get_model_state_dict / set_model_state_dict with "
          "StateDictOptions(full_state_dict=True), which gather the DTensors whole, as on FSDP2")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict()`` on every rank (the fp32 master values)."""
    units = units_of(model)  # the same order on every rank
    placement.refuse(units, "zero.full_state_dict", TP_FIX)
    adoption.adopt_agreed(units, "gather a full state dict",
                          fix="Call zero.full_state_dict on every rank (it is collective), then "
                              "keep what you need on rank 0")
    try:
        for unit in units:
            unit.use(unit.layout.views(_gathered(unit)))
        with state_dict_access():
            return model.state_dict()
    finally:
        for unit in units:
            unit.use_sharded_params()


def _gathered(unit) -> torch.Tensor:
    """The unit's parameters whole, laid out as it computes with them (rows: copied out)."""
    flat = unit.sharded.new_empty(unit.layout.padded_numel)
    # (S,) per rank -> (N*S,): the master weights, whole
    comm.all_gather(flat, unit.sharded, group=unit.group, unit=unit.name, phase="other",
                    ctx=unit.root.context)
    return unit.layout.from_wire(flat)


def load_full_state_dict(model: nn.Module, state_dict: dict, strict: bool = True,
                         broadcast_from_rank0: bool = False):
    """Load a full (unsharded) state dict, such as ``full_state_dict`` returns, on every rank.

    Args:
        model: the sharded model; state_dict: its full state, keyed as ``full_state_dict``.
        strict: as ``nn.Module.load_state_dict``'s; with False, what the dict lacks keeps its value.
        broadcast_from_rank0: FSDP2's: only rank 0's ``state_dict`` is read (the others may
            pass ``{}``), and its values are sent to every rank. Without it every rank must
            pass the same values: ranks whose values differ raise.

    Returns:
        What ``nn.Module.load_state_dict`` returns, on every rank (rank 0's with
        ``broadcast_from_rank0``, as FSDP2's ``set_model_state_dict``).
    """
    units = units_of(model)
    placement.refuse(units, "zero.load_full_state_dict", TP_FIX)
    _refuse_meta(model)
    group, ctx = units[0].all_group, units[0].root.context
    adoption.adopt_agreed(units, f"load a full state dict (broadcast_from_rank0="
                                 f"{broadcast_from_rank0})",
                          fix="Call zero.load_full_state_dict on every rank, with the same "
                              "broadcast_from_rank0")
    reads = not broadcast_from_rank0 or ctx.backend.rank(group) == 0
    fulls, result, names = {}, None, []
    try:
        for unit in units:  # the values now: torch overwrites only what the dict holds
            fulls[unit] = _gathered(unit)
            unit.use(unit.layout.views(fulls[unit]))  # torch copies each tensor in here
        with comm.raising_together(group, ctx=ctx):
            if reads:
                with state_dict_access():
                    result = model.load_state_dict(state_dict, strict=strict)
        comm.agree("loaded a full state dict", group=group, ctx=ctx)  # (or one rank raised)
        names = list(model.named_parameters())  # (the views, filled)
        if not broadcast_from_rank0:
            try:
                same_model.check_same_values(names, group, ctx)
            except ValueError as e:
                raise ValueError(
                    f"zero.load_full_state_dict: {e}. If the state dict was read on rank 0 "
                    "only, pass broadcast_from_rank0=True: the other ranks then get rank 0's "
                    "values") from None
    finally:
        for unit in units:
            unit.use_sharded_params()
    if broadcast_from_rank0:
        for unit, flat in fulls.items():  # (N*S,) rank 0's -> every rank's, unit by unit
            comm.broadcast(flat, src=0, group=group, unit=unit.name, phase="other", ctx=ctx)
        outside = [p for p in model.parameters() if not is_piece(p)]  # no unit shards them
        same_model.take_rank0_values([model], outside, group, ctx)  # and the buffers
        keys = comm.all_gather_object(result and tuple(result), group=group, ctx=ctx)[0]
        result = _IncompatibleKeys(*keys)
    _write_shards(fulls, loaded=result is None or not result.missing_keys)
    return result


def _refuse_meta(model: nn.Module) -> None:
    """What no unit shards and is still on the meta device cannot take values: name it."""
    on_meta = [n for n, t in [*model.named_buffers(), *model.named_parameters()]
               if t.is_meta and not is_piece(t)]  # (the units' shards are real already)
    if on_meta:
        raise RuntimeError(
            f"zero.load_full_state_dict: {', '.join(on_meta[:3])}"
            f"{f' and {len(on_meta) - 3} more' if len(on_meta) > 3 else ''} on the meta device "
            "(the model was built there), which no unit shards: call "
            "model.to_empty(device=...) first, as with FSDP2, then load")


def _write_shards(fulls: dict, loaded: bool) -> None:
    """Each unit's slice of its loaded full buffer into its shard."""
    for unit, flat in fulls.items():
        unit.wait_unshard()  # a stage 1/2 gather may still read the shard
        with torch.no_grad():
            # our slice (rows: of the rank-major buffer); the next forward gathers the rest
            unit.sharded.copy_(unit.layout.to_wire(flat)[unit.local.slot])
        if not unit.materialized and loaded:  # sharded on meta (fully_shard): now it has
            unit.params_on_shard()  # values, and its parameters show them (FSDP2's
            unit.materialized = True  # set_model_state_dict gives a meta model its values)
