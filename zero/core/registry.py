"""Who owns what: the marks zero leaves on modules and parameters, written and read only here.

    piece._zero_unit, piece._zero_index   the unit a sharded parameter belongs to, its index
    module._zero_units                    the units zero.shard(module) made (trainable, frozen)
    original._zero_replaced               the unit that replaced this original parameter
    param._zero_ignored                   left whole by ``ignored_params``
"""

from __future__ import annotations

import torch.nn as nn


def mark_piece(piece: nn.Parameter, unit, index: int) -> None:
    setattr(piece, "_zero_unit", unit)  # (marks on torch's objects: set by name)
    setattr(piece, "_zero_index", index)


def unit_of(param):
    """The unit whose piece ``param`` is, or None (not sharded by zero)."""
    return getattr(param, "_zero_unit", None)


def index_of(param) -> int:
    """Which of its unit's parameters ``param`` is (``unit.params[i]``)."""
    return getattr(param, "_zero_index")


def piece_of(param):
    """The ``flat.Piece`` the sharded ``param`` holds on this rank, or None."""
    unit = unit_of(param)
    return None if unit is None else unit.local.pieces.get(index_of(param))


def is_piece(param) -> bool:
    return hasattr(param, "_zero_unit")


def attach(module: nn.Module, units: list) -> None:
    setattr(module, "_zero_units", units)


def units_on(module: nn.Module) -> list:
    """The units ``zero.shard(module)`` made: one, or two (trainable, frozen); [] if none."""
    return getattr(module, "_zero_units", [])


def unit_on(module: nn.Module):
    """The main (trainable) unit made from ``module``, or None."""
    units = units_on(module)
    return units[0] if units else None


def units_of(model: nn.Module) -> list:
    """The units in ``model``, in module order (the same order on every rank)."""
    units = list({u: None for m in model.modules() for u in units_on(m)})
    if not units:
        raise ValueError(f"{type(model).__name__} has no unit: call zero.shard on it first")
    return units


def mark_replaced(original: nn.Parameter, unit) -> None:
    setattr(original, "_zero_replaced", unit)


def replaced_by(param):
    """The unit that replaced ``param`` (an original parameter held from before sharding)."""
    return getattr(param, "_zero_replaced", None)


def mark_ignored(param: nn.Parameter) -> None:
    setattr(param, "_zero_ignored", True)


def is_ignored(param) -> bool:
    return getattr(param, "_zero_ignored", False)
