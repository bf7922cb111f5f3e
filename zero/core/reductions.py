"""The order reduce-scatters start in: a rule every rank follows alike, one per root.

Collectives pair up by the order they are issued in, so every rank must issue the reductions
in the same order. Stages 2/3 start each as its gradient completes, as FSDP2 does, and keep
``depth`` in flight (1 by default): a unit's reduce-scatter runs under the next unit's
backward, and that unit's post-backward ends it just before issuing its own, as FSDP2's
``post_backward`` does. So two full gradients are alive at the peak besides the shards: the
one being reduced and the one being computed (with ``zero.shard(..., reduce_scatter_depth=k)``
or FSDP2's ``set_reduce_scatter_max_input_buffers(k)``, k + 1: memory for overlap when the
reductions are slower than a unit's backward). The last is ended at the end of backward.
Stage 1, which keeps every full gradient until the step anyway, lets them all fly, and starts
them in one fixed order (the units' own, reversed: backward's usual one), each once those
before it have started, as DDP starts its buckets; so units may run in another order on each
rank.

When a gather starts is a policy (``zero/core/schedule.py``); this is not: a rank that started
its reductions in another order would exchange the wrong units' gradients.
"""

from __future__ import annotations

from zero.comm.context import label


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
        with label("post_backward_reduce", unit.name):
            unit.grads.start_reduce(self.root.context)

    def end_in_flight(self) -> None:
        """Before a reduce-scatter that frees a full gradient (stages 2/3) is issued: end those
        in flight, the oldest first, until fewer than ``depth`` remain (one by default: none
        is left). Each unit's own ``reduction`` says which fly (nothing here keeps a second
        record of it)."""
        flying = [u for u in dict.fromkeys(self.started)
                  if not u.grads.keeps_full and u.grads.reduction is not None]
        for u in flying[: max(0, len(flying) - self.depth + 1)]:
            with label("post_backward_rs_wait", u.name):
                u.grads.wait_reduce(self.root.context)

    @property
    def depth(self) -> int:
        """Reductions in flight: the root's ``reduce_scatter_depth``, or the most any unit
        was set to (FSDP2 resolves its per-module settings to one per root the same way)."""
        given = self.root.given.get("reduce_scatter_depth") or 1
        return max([given, *(u.controls.max_in_flight for u in self.units)])

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
