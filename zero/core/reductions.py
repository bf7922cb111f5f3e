"""The order reduce-scatters start in: a rule every rank follows alike, one per root.

Collectives pair up by the order they are issued in, so every rank must issue the reductions
in the same order. Stages 2/3 start each as its gradient completes, as FSDP2 does, and keep at
most one in flight, ended before the next unit's gradient begins, so that one unit's full
gradient is alive at a time besides the shards (FSDP2's
``set_reduce_scatter_max_input_buffers(k)`` lets k fly: ``max_in_flight``, memory for overlap
when the reductions are slower than backward). Stage 1, which keeps every full gradient until
the step anyway, lets them all fly, and starts them in one fixed order (the units' own,
reversed: backward's usual one), each once those before it have started, as DDP starts its
buckets; so units may run in another order on each rank.

When a gather starts is a policy (``zero/core/schedule.py``); this is not: a rank that started
its reductions in another order would exchange the wrong units' gradients.
"""

from __future__ import annotations


class Reductions:
    """Args:
    units: every unit under the root, in module order, the root first.
    root: the per-root context (``zero/core/root.py``): every reduction is issued through
        its ``CommContext``, whichever it holds then (``share_comm_ctx`` may swap it).
    """

    def __init__(self, units: list, root):
        self.units, self.root = units, root
        self.queue: list | None = None  # stage 1: the order reductions start in
        self.ready: set = set()  # units whose gradient is complete, waiting for their turn
        self.started: list = []  # reductions started since the root's last forward

    def reset(self) -> None:
        """A new iteration after one that failed part-way: forget what was queued."""
        self.queue, self.ready = None, set()

    def reduce(self, unit) -> None:
        """``unit``'s gradient is complete: start its reduce-scatter, or queue it (see the
        module docstring: stages 2/3 at once, stage 1 in the units' fixed order)."""
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
        # Otherwise it started already, and this is the second part of its gradient (a unit
        # run twice under reentrant checkpointing): the end of backward reduces it.

    def _issue(self, unit) -> None:
        """Stage 1 reduces in place into a gradient it keeps anyway: all of them may fly at
        once. Otherwise (a full gradient to free, or an upcast copy) after the one in flight:
        at most one at a time."""
        self.started.append(unit)
        if not unit.grads.keeps_full:
            self.end_in_flight()
        unit.grads.start_reduce(self.root.context)

    def end_in_flight(self) -> None:
        """End the reduce-scatters in flight that free a full gradient (stages 2/3), the
        oldest first, until fewer than ``max_in_flight`` remain (one by default: none is left):
        each unit's own ``reduction`` says so (nothing here keeps a second record of it)."""
        flying = [u for u in dict.fromkeys(self.started)
                  if not u.grads.keeps_full and u.grads.reduction is not None]
        most = max((u.grads.max_in_flight for u in self.units), default=1)
        for u in flying[: max(0, len(flying) - most + 1)]:
            u.grads.wait_reduce(self.root.context)

    def finish(self, synced: list) -> None:
        """The end of backward: every gradient not yet reduced, in the units' order, which
        every rank shares (stage 1's still queued and its second parts, stage 1's in mixed
        precision, which lived until now whole, and any unit whose hook never fired this
        backward but that holds no_sync micro-batches); then wait for them all."""
        for u in synced:
            u.grads.zeros_if_unused()  # (FSDP2's set_reduce_scatter_unused_params)
            if u.grads.has_unsynced():
                self._issue(u)
        self.queue, self.ready = None, set()

    def wait(self, synced: list) -> None:
        for u in synced:
            u.grads.wait_reduce(self.root.context)
