"""The root: the unit with no unit above it, and what it does for every unit below it.

FSDP2 has the same idea (its root state). Only the root can
- name the units by their paths and list them (lazily, at the first forward);
- start each iteration clean: if the last forward or backward raised part-way, some unit
  is still mid-iteration, and ``begin_forward`` resets every unit first (discarding the
  failed iteration's gradients, as FSDP2's ``reset_iter_state`` does);
- agree with the other ranks on what happened since the last forward, before any unit
  gathers (``zero/comm/agree.py``), and broadcast buffers if asked (DDP's way);
- hold the schedule of prefetches and reductions (``zero/core/schedule.py``) and the guard
  against reading freed parameters (``zero/core/saved_tensors.py``);
- queue one callback for the end of backward that finishes every unit: the last
  reduce-scatters (and stage 1's in mixed precision), agreeing on which parameters got a
  gradient, handing the gradient shards to the parameters, and freeing stage 3's parameters.

The root's duties live in one ``Root`` object, made when a unit of the model first needs it
(``root_of``) and kept on the root unit.
"""

from __future__ import annotations

import warnings

import torch

from zero import comm
from zero.core import adoption, registry, running_stats
from zero.core.saved_tensors import Guard
from zero.core.schedule import Schedule
from zero.core.state import TrainingState


def root_of(unit) -> "Root":
    """The root's duties for ``unit``'s model (made at the first call: lazy init)."""
    top = unit
    while top.parent is not None:
        top = top.parent
    if top.root_state is None:
        top.root_state = Root(top)
    return top.root_state


class Root:
    def __init__(self, unit):
        self.unit = unit
        self._units: list | None = None
        self._guard: Guard | None = None
        self._schedule: Schedule | None = None
        self._callback_queued = False
        self.backwards = 0  # backward passes since the root's last forward began

    @property
    def units(self) -> list:
        """All units under the root, the root first, named by their module paths."""
        if self._units is None:
            self._units = []
            paths: dict = {}
            for path, mod in self.unit.module.named_modules():
                for unit in registry.units_on(mod):
                    paths.setdefault(unit, []).append(path or "root")
            for unit, names in paths.items():  # a unit of several modules: "tok_emb+head"
                unit.rename("+".join(names) + (" (frozen)" if unit.sibling_of else ""))
                self._units.append(unit)
            running_stats.warn_if_they_drift(self.unit)  # once: BatchNorm's buffers drift
        return self._units

    @property
    def guard(self) -> Guard:
        if self._guard is None:
            self._guard = Guard([u for u in self.units if u.stage.frees_parameters])
        return self._guard

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            self._schedule = Schedule(self.units, prefetch=self.unit.controls.prefetch)
        return self._schedule

    # ---- the start of an iteration ---------------------------------------------------

    def begin_forward(self) -> None:
        """The root's forward starts: reset what a failure left behind, agree with the other
        ranks on what happened since the last forward, refresh the written shards."""
        stuck = {u.state for u in self.units} - {TrainingState.IDLE}
        if self._callback_queued or stuck - {TrainingState.FORWARD}:
            warnings.warn(
                "the previous backward raised before it finished: zero discarded its gradients "
                "(and those of any no_sync micro-batches before it) and starts this iteration "
                "afresh, like FSDP2's reset_iter_state()", stacklevel=4)
            self.reset(discard_gradients=True)
        elif stuck:  # the previous forward raised: its gradients were never computed
            self.reset(discard_gradients=False)
        written = [u for u in self.units if u.shard_written()]
        comm.agree(self._since_last_forward(written) + adoption.pending(self.units),
                   group=self.unit.all_group,
                   ctx=self.unit.mesh.context,
                   device=self.unit.unsharded.device,
                   fix="Every rank must run the same forward and backward passes, under the same "
                       "no_sync, and the same opt.step(). A GradScaler must agree on found_inf "
                       "across ranks (zero.ShardedGradScaler); an `if finite:` guard must test a "
                       "value every rank shares (a norm from zero.clip_grad_norm_). An evaluation "
                       "forward (under torch.no_grad()) gathers parameters too: run it on every "
                       "rank, or evaluate on one rank with an unsharded copy of the model loaded "
                       "from zero.full_state_dict(model), which every rank must call")
        self.backwards, self.schedule.reduced = 0, []
        for u in written:
            u.shard_changed()  # stages 1/2 gather the new parameters (async); stage 3 frees
        if self.unit.controls.broadcast_buffers:
            self._broadcast_buffers()

    def _since_last_forward(self, written: list) -> str:
        names = lambda units: ", ".join(u.name for u in units) or "none"  # noqa: E731
        # Units run in another order on another rank pair their collectives wrongly: stage 3's
        # all-gathers, stage 2/3's reduce-scatters (a check before each collective would tell
        # at once: ZERO_CHECK). Stage 1 starts its reductions in a fixed order (schedule.py).
        schedule = self.schedule
        ran = schedule.order or schedule.last_order
        order = ""
        if self.unit.stage.frees_parameters:
            order += f", in the order {names(ran)}"
        if not self.unit.stage.keep_grads:
            order += f", reduced {names(schedule.reduced)}"
        mode = "" if torch.is_grad_enabled() else " under no_grad"  # (an evaluation on one rank)
        return (f"start a forward{mode} after {self.backwards} backward(s) since the last one; "
                f"shards written (opt.step) in units: {names(written)}; units in no_sync: "
                f"{names([u for u in self.units if not u.controls.requires_grad_sync])}; the last "
                f"forward ran {len(ran)} unit(s){order}")

    def _broadcast_buffers(self) -> None:
        """DDP's ``broadcast_buffers``: rank 0's buffers everywhere, one collective per dtype."""
        buffers = [b for b in self.unit.module.buffers() if b.numel()]
        for dtype in sorted({b.dtype for b in buffers}, key=str):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            comm.broadcast(flat, src=0, group=self.unit.all_group, unit="root", phase="forward",
                           ctx=self.unit.mesh.context)
            for b, v in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(v.view_as(b))

    def reset(self, discard_gradients: bool) -> None:
        self.guard.reset()
        for u in self.units:
            u.wait_unshard()
            if discard_gradients:
                u.grads.discard()
            u.end_iteration()
        self._callback_queued = False
        self.schedule.reset()

    # ---- the end of backward ----------------------------------------------------------

    def queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """Runs once when the whole backward is done: end the reductions, hand out grads, free."""
        synced = [u for u in self.units if u.controls.requires_grad_sync]  # the rest accumulate
        self.schedule.finish_backward(synced)
        # A parameter unused on this rank may be used on another: agree on "used" (max),
        # like DDP's find_unused_parameters, with one small all-reduce per backward, in flight
        # while the last reduce-scatters end.
        used = [f for u in synced for f in u.grads.used]
        flags = work = None
        if used and not comm.simulated(self.unit.group):
            flags = torch.tensor(used, dtype=torch.uint8, device=self.unit.unsharded.device)
            work = comm.all_reduce(flags, op="max", group=self.unit.all_group, unit="root",
                                   ctx=self.unit.mesh.context,
                                   phase="backward", async_op=True)
        self.schedule.wait_reductions(synced)
        if work is not None:
            work.wait()
            used = [bool(f) for f in flags.tolist()]
        offset = 0
        for u in synced:
            u.grads.assign(used[offset : offset + len(u.params)])
            offset += len(u.params)
        for u in self.units:
            if not u.controls.requires_grad_sync:
                u.grads.mark_unsynced()  # so that zero_grad() can discard it, as with DDP
            u.end_iteration()
        self._callback_queued = False
        self.backwards += 1
