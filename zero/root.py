"""The root: the unit with no unit above it, and what it does for every unit below it.

FSDP2 has the same idea (its root state). Only the root can
- name the units by their paths and list them (lazily, at the first forward);
- start each iteration clean: if the last forward or backward raised part-way, some unit
  is still mid-iteration, and ``begin_forward`` resets every unit first (discarding the
  failed iteration's gradients, as FSDP2's ``reset_iter_state`` does);
- know the order in which units run forward, which stage 3 uses to prefetch: while a unit
  computes, the *next* unit's all-gather is already running (in backward: the previous
  unit's), so at most two units are unsharded at once besides any that keep their
  parameters (the root, by default);
- bound the reduce-scatters in flight during backward to one, ended before the next unit's
  gradient begins, so that one unit's full gradient is alive at a time besides the shards
  (stage 1, which keeps every full gradient until the step anyway, lets them all fly);
- queue one callback for the end of backward that finishes every unit: the last
  reduce-scatters (and stage 1's in mixed precision), agreeing on which parameters got a
  gradient, handing the gradient shards to the parameters, and freeing stage 3's parameters.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from zero import comm, hooks
from zero.guard import Guard
from zero.hooks import State

if TYPE_CHECKING:
    from zero.unit import Unit


class Root:
    def __init__(self, unit: "Unit"):
        self.unit = unit
        self._units: list[Unit] | None = None
        self._guard: Guard | None = None
        self.order: list[Unit] = []  # units in the order their forward ran, this iteration
        self.last_order: list[Unit] = []  # the same for the previous iteration
        self._callback_queued = False
        self._reducing: Unit | None = None  # whose reduce-scatter is in flight
        self._queue: list[Unit] | None = None  # stage 1: the order reductions start in
        self._ready: set = set()  # units whose gradient is complete, waiting for their turn
        self.reduced: list[Unit] = []  # reductions started since the root's last forward
        self._deferred: list[Unit] = []  # stage 3: to free once their backward is surely over
        self.backwards = 0  # backward passes since the root's last forward began

    @property
    def units(self) -> list["Unit"]:
        """All units under the root, the root first, named by their module paths."""
        if self._units is None:
            self._units = []
            paths: dict = {}
            for path, mod in self.unit.module.named_modules():
                for unit in getattr(mod, "_zero_units", []):
                    paths.setdefault(unit, []).append(path or "root")
            for unit, names in paths.items():  # a unit of several modules: "tok_emb+head"
                unit.name = "+".join(names) + (" (frozen)" if unit.sibling_of else "")
                self._units.append(unit)
        return self._units

    @property
    def guard(self) -> Guard:
        if self._guard is None:
            self._guard = Guard([u for u in self.units if not u.stage.keep_params])
        return self._guard

    # ---- the start of an iteration ---------------------------------------------------

    def begin_forward(self) -> None:
        """The root's forward starts: reset what a failure left behind, agree with the other
        ranks on what happened since the last forward, refresh the written shards."""
        stuck = {u.state for u in self.units} - {State.IDLE}
        if self._callback_queued or stuck - {State.FORWARD}:
            warnings.warn(
                "the previous backward raised before it finished: zero discarded its gradients "
                "(and those of any no_sync micro-batches before it) and starts this iteration "
                "afresh, like FSDP2's reset_iter_state()", stacklevel=4)
            self.reset(discard_gradients=True)
        elif stuck:  # the previous forward raised: its gradients were never computed
            self.reset(discard_gradients=False)
        written = [u for u in self.units if u.shard_written()]
        comm.agree(self._since_last_forward(written), group=self.unit.all_group,
                   device=self.unit.sharded.device,
                   fix="Every rank must run the same forward and backward passes, under the same "
                       "no_sync, and the same opt.step(). A GradScaler must agree on found_inf "
                       "across ranks (zero.ShardedGradScaler); an `if finite:` guard must test a "
                       "value every rank shares (a norm from zero.clip_grad_norm_)")
        self.backwards, self.reduced = 0, []
        for u in written:
            u.shard_changed()  # stages 1/2 gather the new parameters (async); stage 3 frees
        if self.unit.broadcast_buffers:
            self._broadcast_buffers()

    def _since_last_forward(self, written: list["Unit"]) -> str:
        names = lambda units: ", ".join(u.name for u in units) or "none"  # noqa: E731
        # Units run in another order on another rank pair their collectives wrongly: stage 3's
        # all-gathers, stage 2/3's reduce-scatters (a check before each collective would tell
        # at once: ZERO_CHECK). Stage 1 starts its reductions in a fixed order (reduce).
        order = ""
        if not self.unit.stage.keep_params:
            order += f", in the order {names(self.order or self.last_order)}"
        if not self.unit.stage.keep_grads:
            order += f", reduced {names(self.reduced)}"
        return (f"start a forward after {self.backwards} backward(s) since the last one; shards "
                f"written (opt.step) in units: {names(written)}; units in no_sync: "
                f"{names([u for u in self.units if not u.requires_grad_sync])}; the last "
                f"forward ran {len(self.order or self.last_order)} unit(s){order}")

    def _broadcast_buffers(self) -> None:
        """DDP's ``broadcast_buffers``: rank 0's buffers everywhere, one collective per dtype."""
        buffers = [b for b in self.unit.module.buffers() if b.numel()]
        for dtype in sorted({b.dtype for b in buffers}, key=str):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            comm.broadcast(flat, src=0, group=self.unit.all_group, unit="root", phase="forward")
            for b, v in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(v.view_as(b))

    def reset(self, discard_gradients: bool) -> None:
        self.guard.reset()
        for u in self.units:
            u.wait_unshard()
            if discard_gradients:
                u.discard_gradients()
            u.end_iteration()
        self._callback_queued, self._reducing, self.order = False, None, []
        self._queue, self._ready, self._deferred = None, set(), []

    # ---- prefetching ------------------------------------------------------------------

    def forward_started(self, unit: "Unit") -> None:
        """``unit`` starts its forward: record it, and start gathering the unit after it."""
        if unit is self.unit:  # the root's forward opens an iteration
            self.last_order, self.order = self.order or self.last_order, []
        pos = len(self.order)
        self.order.append(unit)
        if unit.forward_prefetch is not None:  # set_modules_to_forward_prefetch
            nexts = unit.forward_prefetch
        else:
            nxt = self.last_order[pos + 1] if pos + 1 < len(self.last_order) else None
            nexts = [nxt] if nxt is not None and self.last_order[pos] is unit else []
        for nxt in nexts:
            if not nxt.stage.keep_params:
                nxt.unshard(phase="forward", async_op=True)

    def defer_reshard(self, unit: "Unit") -> None:
        """``unit``'s gradient completed inside a recompute's backward (hooks.py's note)."""
        if unit not in self._deferred:
            self._deferred.append(unit)

    def free_deferred(self, but: "Unit") -> None:
        """Another unit's backward (or recompute) starts: free the units deferred till then."""
        for u in self._deferred:
            if u is not but:
                hooks.reshard_after_backward(u)
        self._deferred = [u for u in self._deferred if u is but]

    def backward_started(self, unit: "Unit") -> None:
        """``unit`` starts its backward: start gathering the unit that ran before it."""
        self.queue_final_callback()
        if self._reducing is not None and not unit.stage.keep_grads:
            # The previous unit's reduce-scatter ends before this unit's gradient begins:
            # then at most one full gradient is alive, besides the one being formed.
            self._reducing.wait_reduce()
            self._reducing = None
        if unit.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            prevs = unit.backward_prefetch
        else:
            idx = max((i for i, u in enumerate(self.order) if u is unit), default=0)
            prevs = [self.order[idx - 1]] if idx > 0 else []
        for prev in prevs:
            if not prev.stage.keep_params:
                prev.unshard(phase="backward", async_op=True)

    def reduce(self, unit: "Unit") -> None:
        """``unit``'s gradient is complete: start its reduce-scatter, or queue it.

        Collectives pair up by the order they are issued in, so every rank must issue the
        reductions in the same order. Stages 2/3 start each as its gradient completes, as
        FSDP2 does: the same order on every rank as long as the ranks run their units in the
        same order (the next forward's agreement checks it). Stage 1 can do better at no cost,
        since it keeps every full gradient anyway: it starts them in one fixed order, the
        units' own in reverse (backward's usual one), each once those before it have started,
        as DDP starts its buckets, so units may run in another order on each rank."""
        if not unit.keeps_full_gradient:
            self._issue(unit)  # (stage 1 through a cast: at the end of backward, not here)
            return
        if self._queue is None:  # the first gradient of this backward
            self._queue = [u for u in reversed(self.units) if u.keeps_full_gradient and
                           u.forward_calls and u.requires_grad_sync and u.unsharded.requires_grad]
        if unit in self._queue:
            self._ready.add(unit)
            while self._queue and self._queue[0] in self._ready:
                self._issue(self._queue.pop(0))
        # Otherwise it started already, and this is the second part of its gradient (a unit
        # run twice under reentrant checkpointing): the end of backward reduces it.

    def _issue(self, unit: "Unit") -> None:
        """Stage 1 reduces in place into a gradient it keeps anyway: all of them may fly at
        once. Otherwise (a full gradient to free, or an upcast copy) after the one in flight:
        at most one at a time."""
        self.reduced.append(unit)
        if unit.keeps_full_gradient:
            unit.reduce_grad()
            return
        if self._reducing is not None:
            self._reducing.wait_reduce()
        unit.reduce_grad()
        self._reducing = unit

    # ---- the end of backward ----------------------------------------------------------

    def queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """Runs once when the whole backward is done: end the reductions, hand out grads, free."""
        self.last_order, self.order = self.order, []
        synced = [u for u in self.units if u.requires_grad_sync]  # the rest keep accumulating
        # Every gradient not yet reduced, in the units' order, which every rank shares: stage
        # 1's still queued and its second parts (reduce), stage 1's in mixed precision, which
        # lived until now whole, and any unit whose hook never fired this backward but that
        # holds no_sync micro-batches.
        for u in synced:
            if u.has_unsynced_gradient():
                self._issue(u)
        self._queue, self._ready, self._deferred = None, set(), []
        # A parameter unused on this rank may be used on another: agree on "used" (max),
        # like DDP's find_unused_parameters, with one small all-reduce per backward, in flight
        # while the last reduce-scatters end.
        used = [f for u in synced for f in u._used]
        flags = work = None
        if used and not comm.simulated(self.unit.group):
            flags = torch.tensor(used, dtype=torch.uint8, device=self.unit.unsharded.device)
            work = comm.all_reduce(flags, op="max", group=self.unit.all_group, unit="root",
                                   phase="backward", async_op=True)
        for u in synced:
            u.wait_reduce()
        self._reducing = None
        if work is not None:
            work.wait()
            used = [bool(f) for f in flags.tolist()]
        offset = 0
        for u in synced:
            u.assign_grads(used[offset : offset + len(u.params)])
            offset += len(u.params)
        for u in self.units:
            if not u.requires_grad_sync:
                u.mark_unsynced()  # so that zero_grad() can discard it, as with DDP
            u.end_iteration()
        self._callback_queued = False
        self.backwards += 1
