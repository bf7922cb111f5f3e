"""The schedule: which units' all-gathers start ahead of need (prefetch).

This is where a new prefetch policy goes (``zero/api.py``'s ``Schedule``: two methods). It
decides only *which* units to gather early; the root gathers them (``zero/core/root.py``),
and what a gather does is the unit's (``zero/core/unit.py``). The order reductions start in
is not a policy but a rule every rank must follow alike (``zero/core/reductions.py``).

- Forward prefetch: while a unit computes, the *next* unit's all-gather is already running
  (the one that ran after it last iteration, or ``set_modules_to_forward_prefetch``'s list);
  backward prefetch likewise gathers the unit that ran *before* it in this iteration's
  forward (or ``set_modules_to_backward_prefetch``'s list). So at most two units are
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
        if unit.controls.forward_prefetch is not None:  # set_modules_to_forward_prefetch
            return unit.controls.forward_prefetch
        pos = len(order.this_iteration) - 1
        last = order.last_iteration
        return self.ahead(last, pos) if pos < len(last) and last[pos] is unit else []

    def backward_prefetch(self, unit, order) -> list:
        """``unit`` starts its backward: the units that ran before it in this forward."""
        if unit.controls.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            return unit.controls.backward_prefetch
        ran = order.this_iteration
        pos = max((i for i, u in enumerate(ran) if u is unit), default=0)
        return self.behind(ran, pos)
