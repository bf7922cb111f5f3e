"""The schedule: which units' all-gathers start ahead of need (prefetch). A new prefetch policy
goes here (``zero/api.py``'s ``Schedule``); notes/05-stage3.md, "Prefetch"."""

from __future__ import annotations


class Schedule:
    """zero's own ``Schedule``: FSDP2's implicit prefetching, ``prefetch`` units ahead (1)."""

    def __init__(self, prefetch: int = 1):
        self.prefetch = prefetch

    def __repr__(self) -> str:
        return f"Schedule(prefetch={self.prefetch})"

    def ahead(self, order: list, pos: int) -> list:
        """The units gathered while ``order[pos]`` computes its forward: the next ones."""
        return order[pos + 1 : pos + 1 + self.prefetch]

    def behind(self, order: list, pos: int) -> list:
        """The units gathered while ``order[pos]`` computes its backward: the nearest first."""
        return order[max(0, pos - self.prefetch) : pos][::-1]

    def forward_prefetch(self, unit, order) -> list:
        """The units that ran after ``unit`` last iteration, if this one runs as it did."""
        pos = len(order.this_iteration) - 1
        last = order.last_iteration
        return self.ahead(last, pos) if pos < len(last) and last[pos] is unit else []

    def backward_prefetch(self, unit, order) -> list:
        """The units whose forward ended before ``unit``'s (FSDP2's post-forward order)."""
        ended = order.post_forward
        pos = max((i for i, u in enumerate(ended) if u is unit), default=None)
        if pos is None:  # (its forward ran under no_grad, say): by the order forwards began
            ended = order.this_iteration
            pos = max((i for i, u in enumerate(ended) if u is unit), default=0)
        return self.behind(ended, pos)
