"""Adoption: what a client puts in a module's parameter slots after ``zero.shard``.

FSDP2's clients replace parameters after sharding, and FSDP2 adopts the new ones
(``FSDPParam.reset_sharded_param``, at lazy init and after ``load_state_dict``): torchtune
and accelerate load with ``load_state_dict(sd, assign=True)``, transformers with ``setattr``
and then ties the embeddings with ``tie_weights()``. A unit finds what changed by comparing
each slot of each of its parameters (``ShardedParam.locations``) with the sharded parameter
it put there, and takes it, or refuses it by name:

- a tensor of the parameter's full shape: its values go into the shard, and it becomes the
  sharded parameter (``ShardedParam.adopt``): an optimizer built from it steps the shard;
- another parameter of the same unit (a tie made after sharding: ``head.weight =
  emb.weight``): the slot joins that parameter's slots, exactly what a tie made before
  sharding is, one parameter used in two places (``ShardedParam.take_slots``). Autograd sums
  both uses into its gradient before the reduction, as in DDP and the unsharded model. (FSDP2
  instead points both of its ``FSDPParam``s at one sharded tensor and adds their gradients
  after reducing each: the same tie, summed in another order, ulps apart.) The head's own
  piece of the shard is left unused, as the head's old parameter, which no module holds;
- a parameter of another unit: refused (a tied parameter lives in one unit, the lowest that
  holds all its users; the same rule ``zero.shard`` enforces);
- this rank's own piece converted (``model.half()`` where ``_apply`` makes new parameters:
  the piece's shape, another dtype) or moved to the meta device: refused, naming that
  (``zero/core/guards.py``).

[Note: adoption is agreed] A parameter replaced on one rank only, adopted there alone, would
leave the ranks training different models without a word. So the ranks agree on what they
adopt, as ``zero.shard`` agrees on what it shards: the root's forward agreement says which
parameters were replaced since the last forward (``pending``); the load hook that adopts at
once (``zero/surface/attach.py``) and zero's own readers (``adopt_agreed``) agree first. A
replacement between a forward and its backward is refused (``refuse_before_backward``):
backward computes with the parameters that forward used, and FSDP2, like zero before, drops
the new one silently there.
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
    """What was replaced in ``units`` and not yet adopted, in words every rank can compare
    (names, kinds, dtypes; no shapes, addresses or device indices): "" if nothing."""
    said = [f"{_name(unit, slots[0])} by {_what(new)}"
            for unit in units for _, slots, new in replaced(unit)]
    return f"; parameters replaced since (on every rank alike): {', '.join(said)}" if said else ""


def adopt_replaced(unit) -> bool:
    """Adopt what was put in the unit's slots (the module note); returns whether anything
    changed. Raises, naming the cause, for what cannot be adopted."""
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
    """For zero's own readers (state dicts, checkpoints), which put their tensors in the slots
    and would drop a replacement not yet adopted (a tie made after sharding, saved before any
    forward): agree on ``what`` every rank is about to do and on what each replaced since,
    then adopt it. One agreement, in place of the reader's own."""
    unit = units[0]
    comm.agree(what + pending(units), group=unit.mesh.all_group, ctx=unit.root.context,
               fix=fix)
    for u in units:
        u.adopt_replaced()


def refuse_before_backward(unit) -> None:
    """Backward is about to put the unit's views back in its slots: refuse a parameter
    replaced since forward, which backward would drop (the module note). The unit's own views
    are no replacement: stages 1/2 leave them in the slots until the end of backward, so a
    second output of the unit reached after its gradient completed (T5's position bias, fed
    to every later block) finds them there."""
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
    """What now sits in a slot, in words that do not differ between ranks doing the same (a
    shape can: this rank's 1-D piece, converted by ``model.half()``; told when ``shape``)."""
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
