"""Adoption: what a client puts in a module's parameter slots after ``zero.shard``.

Adopted as FSDP2's ``reset_sharded_param`` does, or refused by name (``zero/core/guards.py``):
notes/18-edge-cases.md, "Parameters replaced after sharding".

[Note: adoption is agreed] Adopted on one rank alone, a replacement would leave the ranks
training different models: the root's forward agreement lists what was replaced
(``pending``), and the load hook and zero's own readers (``adopt_agreed``) agree first.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from zero import comm
from zero.core import guards, registry


def replaced(unit) -> list[tuple]:
    """[(sharded param, [its slots that changed], what is there now)], in the unit's order."""
    out = []
    for sp in unit.sharded_params:  # (every forward: one look per slot, nothing made)
        if all(mod._parameters.get(attr) is sp.sharded for mod, attr in sp.locations):
            continue
        changed: dict[int, tuple] = {}  # id(new) -> (new, [slots])
        for mod, attr in sp.locations:
            t = mod._parameters.get(attr)
            if t is not sp.sharded:
                changed.setdefault(id(t), (t, []))[1].append((mod, attr))
        out += [(sp, slots, new) for new, slots in changed.values()]
    return out


def pending(units: list) -> str:
    """What was replaced in ``units``, in words every rank can compare ("" if nothing)."""
    said = [f"{_name(unit, slots[0])} by {_what(new)}"
            for unit in units for _, slots, new in replaced(unit)]
    return f"; parameters replaced since (on every rank alike): {', '.join(said)}" if said else ""


def adopt_replaced(unit) -> bool:
    """Adopt what was put in the unit's slots, or raise; returns whether anything changed."""
    changed = False
    for sp, slots, new in replaced(unit):
        owner = registry.unit_of(new)
        if owner is unit:  # another parameter of this unit: a tie made after sharding
            unit.sharded_params[registry.index_of(new)].take_slots(sp, slots)
        elif owner is not None:
            raise _tied_across_units(unit, slots[0], owner, new)
        elif _local(new).is_meta:
            guards.on_meta(unit, moved=not sp.sharded.is_meta)
        elif (new.shape == unit.exposed_piece(unit.sharded, sp.index).shape != sp.shape
              and (new.dtype, _local(new).device) != (unit.sharded.dtype, unit.sharded.device)):
            guards.converted(unit, new)  # this rank's piece, converted (model.to(), .half())
        else:
            unit.wait_unshard()  # (a stage 1/2 gather may still read the shard)
            piece = unit.piece(unit.sharded, sp.index)
            shown = sp.adopt(new, piece, unit.exposed_piece(unit.sharded, sp.index), unit.name)
            registry.mark_piece(shown, unit, sp.index)
            sp.use_sharded()
        changed = True
    return changed


def adopt_agreed(units: list, what: str, fix: str) -> None:
    """For zero's own readers: agree on ``what`` and on what was replaced, then adopt it."""
    unit = units[0]
    comm.agree(what + pending(units), group=unit.mesh.all_group, ctx=unit.root.context, fix=fix)
    for u in units:
        u.adopt_replaced()


def refuse_before_backward(unit) -> None:
    """Refuse a parameter replaced since forward (backward would drop it), but the unit's views."""
    views = unit.iteration.views or []
    for sp, slots, new in replaced(unit):
        if sp.index < len(views) and new is views[sp.index]:
            continue
        raise RuntimeError(
            f"'{_name(unit, slots[0])}' was replaced between forward and backward (by "
            f"{_what(new, shape=True)}): backward computes with the parameters forward used, "
            "and the new one would be dropped without a word. Replace parameters before the "
            "forward (or after opt.step()), on every rank")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _name(unit, slot: tuple) -> str:
    """A slot's name in the whole model ("head.weight"), from the top unit's module."""
    top, (mod, attr) = unit, slot
    while top.parent is not None:
        top = top.parent
    for root in top.modules:
        for path, m in root.named_modules():
            if m is mod:
                return f"{path}.{attr}" if path else attr
    return attr


def _what(new, shape: bool = False) -> str:
    """What now sits in a slot, in words alike on every rank (a shape differs: ``shape``)."""
    owner = registry.unit_of(new)
    if owner is not None:
        return f"parameter #{registry.index_of(new)} of unit {owner.name} (a tie)"
    kind = "a DTensor" if isinstance(new, DTensor) else "a tensor"
    return f"{kind}{f' {tuple(new.shape)}' if shape else ''}, {new.dtype} on " \
           f"{_local(new).device.type}"


def _tied_across_units(unit, slot: tuple, owner, new) -> ValueError:
    sp = owner.sharded_params[registry.index_of(new)]
    other = _name(owner, sp.locations[0]) if sp.locations else f"#{sp.index}"
    return ValueError(
        f"'{_name(unit, slot)}' of unit {unit.name} was tied after zero.shard to '{other}' of "
        f"unit {owner.name}: a tied parameter must live in one unit, the lowest that holds "
        "all its users, and these are two. Tie the weights before zero.shard (which then "
        "checks where they live), or shard a module that holds both uses as one unit "
        "(their common parent, or zero.shard([emb, head]))")
