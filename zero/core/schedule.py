"""The schedule: which units' all-gathers start ahead of need (prefetch).

This is where a new prefetch policy goes (``zero/api.py``'s ``Schedule``: two methods). It
decides only *which* units to gather early; the root gathers them (``zero/core/root.py``),
and what a gather does is the unit's (``zero/core/unit.py``). The order reductions start in
is not a policy but a rule every rank must follow alike (``zero/core/reductions.py``).

- Forward prefetch: while a unit computes, the *next* unit's all-gather is already running
  (the one that ran after it last iteration); backward prefetch likewise gathers the unit
  whose forward ended *before* its own in this iteration (FSDP2's post-forward order). The
  user's explicit lists (``set_modules_to_forward_prefetch`` and ``..._backward_prefetch``)
  come first, whatever schedule is plugged in: the root reads them. So at most two units are
  unsharded at once besides any that keep their parameters (the root, by default). With
  ``prefetch=d`` (``zero.shard(root, prefetch=d)``) the next d units are gathered, and at most
  d + 1 are unsharded at once: ``ahead`` and ``behind`` say which, and the bench's memory
  model asks them too (``zerolab/memory.py``).
"""

from __future__ import annotations


class Schedule:
    """zero's own (``zero/api.py``'s ``Schedule``), FSDP2's implicit prefetching with a depth.

    Args:
        prefetch: how many units to gather ahead of the one computing (1: FSDP2's).
    """

    def __init__(self, prefetch: int = 1):
        self.prefetch = prefetch

    def __repr__(self) -> str:
        return f"Schedule(prefetch={self.prefetch})"

    def ahead(self, order: list, pos: int) -> list:
        """The units gathered while ``order[pos]`` computes its forward: the next ones."""
        return order[pos + 1 : pos + 1 + self.prefetch]

    def behind(self, order: list, pos: int) -> list:
        """The units gathered while ``order[pos]`` computes its backward: those before it,
        the nearest first."""
        return order[max(0, pos - self.prefetch) : pos][::-1]

    def forward_prefetch(self, unit, order) -> list:
        """``unit`` starts its forward (the last of ``order.this_iteration``): the units that
        ran after it last iteration, if this iteration runs as the last one did."""
        pos = len(order.this_iteration) - 1
        last = order.last_iteration
        return self.ahead(last, pos) if pos < len(last) and last[pos] is unit else []

    def backward_prefetch(self, unit, order) -> list:
        """``unit`` starts its backward: the units whose forward ended before its own did, in
        this iteration (FSDP2's post-forward order: the root's forward ends last, so while
        the loss and the head run backward the last block is gathered)."""
        ended = order.post_forward
        pos = max((i for i, u in enumerate(ended) if u is unit), default=None)
        if pos is None:  # (its forward ran under no_grad, say): by the order forwards began
            ended = order.this_iteration
            pos = max((i for i, u in enumerate(ended) if u is unit), default=0)
        return self.behind(ended, pos)
