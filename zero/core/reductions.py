"""The order reduce-scatters start in: a rule every rank follows alike, one per root.

Stages 2/3 start each as its gradient completes, ``depth`` in flight (FSDP2's); stage 1 all,
in one fixed order, as DDP's buckets (notes/04-stage2.md, "One reduce-scatter in flight").
"""

from __future__ import annotations

from zero.comm.context import label


class Reductions:
    """The reductions of ``units`` (module order, the root first), issued through ``root``'s
    ``CommContext`` (``zero/core/root.py``)."""

    def __init__(self, units: list, root):
        self.units, self.root = units, root
        self.queue: list | None = None  # stage 1: the order reductions start in
        self.ready: set = set()  # units whose gradient is complete, waiting for their turn
        self.started: list = []  # reductions started since the root's last forward

    def reset(self) -> None:
        """A new iteration after one that failed part-way: forget what was queued."""
        self.queue, self.ready = None, set()

    def reduce(self, unit) -> None:
        """``unit``'s gradient is complete: start its reduce-scatter, or queue it (stage 1)."""
        if not unit.grads.keeps_full:
            self._issue(unit)  # (stage 1 through a cast: at the end of backward, not here)
            return
        if self.queue is None:  # the first gradient of this backward
            self.queue = [u for u in reversed(self.units) if u.grads.keeps_full and
                          u.iteration.forward_calls and u.controls.requires_grad_sync and
                          u.unsharded.requires_grad]
        if unit in self.queue:
            self.ready.add(unit)
            while self.queue and self.queue[0] in self.ready:
                self._issue(self.queue.pop(0))
        # (else: a second part of its gradient, reentrant checkpointing: reduced at the end)

    def _issue(self, unit) -> None:
        """Start it: stage 1's may all fly at once; others after those in flight end."""
        self.started.append(unit)
        if not unit.grads.keeps_full:
            self.end_in_flight()
        with label("post_backward_reduce", unit.name):
            unit.grads.start_reduce(self.root.context)

    def end_in_flight(self) -> None:
        """End reductions in flight (stages 2/3), the oldest first, till fewer than ``depth``."""
        flying = [u for u in dict.fromkeys(self.started)
                  if not u.grads.keeps_full and u.grads.reduction is not None]
        for u in flying[: max(0, len(flying) - self.depth + 1)]:
            with label("post_backward_rs_wait", u.name):
                u.grads.wait_reduce(self.root.context)

    @property
    def depth(self) -> int:
        """Reductions in flight: the root's ``reduce_scatter_depth`` or any unit's, the most."""
        given = self.root.given.get("reduce_scatter_depth") or 1
        return max([given, *(u.controls.max_in_flight for u in self.units)])

    def finish(self, synced: list) -> None:
        """The end of backward: start every gradient not yet reduced, in the units' order."""
        for u in synced:
            u.grads.zeros_if_unused()  # (FSDP2's set_reduce_scatter_unused_params)
            if u.grads.has_unsynced():
                self._issue(u)
        self.queue, self.ready = None, set()

    def wait(self, synced: list) -> None:
        for u in synced:
            u.grads.wait_reduce(self.root.context)
