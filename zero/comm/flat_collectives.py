"""How a unit's flat buffers cross the ranks: the seam a quantized collective replaces.

The mechanism moves two things per unit, and asks this object (``zero/api.py``'s
``CommPolicy``) to move them:

    all_gather      this rank's shard (master dtype)  -> the full flat parameters (compute dtype)
    reduce_scatter  the full flat gradient (reduce dtype) -> this rank's slot of the mean

and, under HSDP, ``all_reduce`` of the shard over the replicas. ZeRO++'s (``zero/features/``)
may send other dtypes and shapes, as long as ``wait()`` leaves the same tensors filled.
"""

from __future__ import annotations

import torch

from zero import api


class FlatCollectives:
    """Cast, then all-gather in place; reduce-scatter in place."""

    in_place_ok = True  # the shard may be this rank's slot of the full buffer (stages 1/2)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, slot: slice, *,
                   in_place: bool, group, unit: str, phase: str, ctx: api.Comm) -> api.Work:
        """Start filling ``full`` (N*S,) from every rank's ``shard`` (S,); ``full[slot]`` is
        this rank's place, and ``in_place``: ``shard`` *is* that slot (stages 1/2, no cast)."""
        mine = full[slot]
        if not in_place:
            mine.copy_(shard)  # cast the fp32 shard to the compute dtype once, before sending
        # (N*S,) <- (S,) per rank; in place: our slot of the output is the input
        return ctx.all_gather(full, mine, group=group, unit=unit, phase=phase, async_op=True)

    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str, ctx: api.Comm) -> api.Work:
        """Start reducing ``grad`` (N*S,) into ``grad[slot]`` (S,), our slice of the sum or mean."""
        # In place: our slice of the mean lands in our own slot of the full gradient, so while
        # the collective runs the unit holds one buffer, not the full gradient and a shard.
        return ctx.reduce_scatter(grad[slot], grad, op=op, group=group, unit=unit, phase=phase,
                                  async_op=True)

    def all_reduce(self, tensor: torch.Tensor, *, op: str, group, unit: str, phase: str,
                   ctx: api.Comm) -> None:
        """Reduce ``tensor`` over ``group`` in place, and wait (HSDP's, over the replicas)."""
        ctx.all_reduce(tensor, op=op, group=group, unit=unit, phase=phase)


DEFAULT = FlatCollectives()
