"""The schedule: which unit's all-gather starts when (prefetch), and which reduce-scatter.

This is where a new prefetch or reduction policy goes. It decides only *when*; what a gather
or a reduction does is the unit's (``zero/core/unit.py``, ``zero/core/grads.py``).

- Forward prefetch: while a unit computes, the *next* unit's all-gather is already running
  (the one that ran after it last iteration, or ``set_modules_to_forward_prefetch``'s list);
  backward prefetch likewise gathers the unit that ran *before* it. So at most two units are
  unsharded at once besides any that keep their parameters (the root, by default). With
  ``prefetch=d`` (``zero.shard(root, prefetch=d)``) the next d units are gathered, and at most
  d + 1 are unsharded at once: ``ahead`` and ``behind`` say which, and the bench's memory
  model asks them too (``zerolab/memory.py``).
- Reductions: collectives pair up by the order they are issued in, so every rank must issue
  the reductions in the same order. Stages 2/3 start each as its gradient completes, as FSDP2
  does, and keep at most one in flight, ended before the next unit's gradient begins, so that
  one unit's full gradient is alive at a time besides the shards. Stage 1, which keeps every
  full gradient until the step anyway, lets them all fly, and starts them in one fixed order
  (the units' own, reversed: backward's usual one), each once those before it have started,
  as DDP starts its buckets; so units may run in another order on each rank.
- Deferred frees: a stage-3 unit whose gradient completed inside a recompute's backward is
  freed when the next unit's backward or recompute starts (``zero/core/hooks.py``'s note).
"""

from __future__ import annotations


class Schedule:
    """One per root (``zero/api.py``'s ``Schedule``).

    Args:
        units: every unit under the root, in module order, the root first.
        prefetch: how many units to gather ahead of the one computing (1: FSDP2's).
    """

    def __init__(self, units: list, prefetch: int = 1):
        self.units, self.prefetch = units, prefetch
        self.order: list = []  # units in the order their forward ran, this iteration
        self.last_order: list = []  # the same for the previous iteration
        self.queue: list | None = None  # stage 1: the order reductions start in
        self.ready: set = set()  # units whose gradient is complete, waiting for their turn
        self.reduced: list = []  # reductions started since the root's last forward
        self.deferred: list = []  # stage 3: to free once their backward is surely over

    def reset(self) -> None:
        """A new iteration after one that failed part-way: forget what was in flight."""
        self.order = []
        self.queue, self.ready, self.deferred = None, set(), []

    # ---- prefetching --------------------------------------------------------------------

    def ahead(self, order: list, pos: int) -> list:
        """The units gathered while ``order[pos]`` computes its forward: the next ones."""
        return order[pos + 1 : pos + 1 + self.prefetch]

    def behind(self, order: list, pos: int) -> list:
        """The units gathered while ``order[pos]`` computes its backward: those before it,
        the nearest first."""
        return order[max(0, pos - self.prefetch) : pos][::-1]

    def forward_started(self, unit, is_root: bool) -> None:
        """``unit`` starts its forward: record it, and start gathering the unit after it."""
        if is_root:  # the root's forward opens an iteration
            self.last_order, self.order = self.order or self.last_order, []
        pos = len(self.order)
        self.order.append(unit)
        if unit.controls.forward_prefetch is not None:  # set_modules_to_forward_prefetch
            nexts = unit.controls.forward_prefetch
        elif pos < len(self.last_order) and self.last_order[pos] is unit:
            nexts = self.ahead(self.last_order, pos)  # as it ran last iteration
        else:
            nexts = []
        for nxt in nexts:
            if nxt.stage.frees_parameters:
                nxt.unshard(phase="forward", async_op=True)

    def backward_started(self, unit) -> None:
        """``unit`` starts its backward: start gathering the unit that ran before it."""
        if not unit.stage.keep_grads and (prev := self._in_flight()) is not None:
            # The previous unit's reduce-scatter ends before this unit's gradient begins:
            # then at most one full gradient is alive, besides the one being formed.
            prev.grads.wait_reduce()
        if unit.controls.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            prevs = unit.controls.backward_prefetch
        else:
            idx = max((i for i, u in enumerate(self.order) if u is unit), default=0)
            prevs = self.behind(self.order, idx)
        for prev in prevs:
            if prev.stage.frees_parameters:
                prev.unshard(phase="backward", async_op=True)

    # ---- deferred frees -----------------------------------------------------------------

    def defer_reshard(self, unit) -> None:
        """``unit``'s gradient completed inside a recompute's backward (hooks.py's note)."""
        if unit not in self.deferred:
            self.deferred.append(unit)

    def free_deferred(self, but) -> None:
        """Another unit's backward (or recompute) starts: free the units deferred till then."""
        for u in self.deferred:
            if u is not but:
                u.release_after_backward()
        self.deferred = [u for u in self.deferred if u is but]

    # ---- reductions ---------------------------------------------------------------------

    def reduce(self, unit) -> None:
        """``unit``'s gradient is complete: start its reduce-scatter, or queue it (see the
        module docstring: stages 2/3 at once, stage 1 in the units' fixed order)."""
        if not unit.keeps_full_gradient:
            self._issue(unit)  # (stage 1 through a cast: at the end of backward, not here)
            return
        if self.queue is None:  # the first gradient of this backward
            self.queue = [u for u in reversed(self.units) if u.keeps_full_gradient and
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
        self.reduced.append(unit)
        if unit.keeps_full_gradient:
            unit.grads.start_reduce()
            return
        if (prev := self._in_flight()) is not None:
            prev.grads.wait_reduce()
        unit.grads.start_reduce()

    def _in_flight(self):
        """The unit whose reduce-scatter is in flight, one at a time (stages 2/3), if any: its
        gradient's own ``reduction`` says so (the schedule keeps no second record of it)."""
        return next((u for u in reversed(self.reduced)
                     if not u.keeps_full_gradient and u.grads.reduction is not None), None)

    def finish_backward(self, synced: list) -> None:
        """The end of backward: every gradient not yet reduced, in the units' order, which
        every rank shares: stage 1's still queued and its second parts, stage 1's in mixed
        precision, which lived until now whole, and any unit whose hook never fired this
        backward but that holds no_sync micro-batches."""
        self.last_order, self.order = self.order, []
        for u in synced:
            if u.grads.has_unsynced():
                self._issue(u)
        self.queue, self.ready, self.deferred = None, set(), []

    def wait_reductions(self, synced: list) -> None:
        for u in synced:
            u.grads.wait_reduce()
