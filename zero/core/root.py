"""The root: the unit with no unit above it, and the per-root context every unit under it shares.

FSDP2's root state and its ``FSDPCommContext``. The ``zero.shard`` of a parent takes the
units below over (``Root.take``); only the root names them, starts each iteration clean
(``begin_forward``), agrees with the other ranks and ends backward (``finish_backward``).
notes/12-model-code.md, "One state per unit".
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from zero import api, comm
from zero.comm.context import label
from zero.core import adoption, registry, running_stats
from zero.core.same_model import describe
from zero.core.reductions import Reductions
from zero.core.saved_tensors import Guard
from zero.core.schedule import Schedule
from zero.core.state import TrainingState

if TYPE_CHECKING:
    from zero.core.unit import Unit

GIVEN = ("backend", "prefetch", "schedule", "reduce_scatter_depth")  # the root's, for every unit


def root_of(unit) -> "Root":
    """The per-root context ``unit`` belongs to."""
    return unit.root


class Order:
    """The units in the order their forward began and ended (``zero/api.py``'s ``Order``)."""

    def __init__(self, units: list):
        self.units = units
        self.this_iteration: list = []
        self.last_iteration: list = []
        self.post_forward: list = []

    def begin(self) -> None:
        self.last_iteration, self.this_iteration = (self.this_iteration or self.last_iteration), []
        self.post_forward = []

    def end(self) -> None:
        """Backward is over: this iteration's order is the next forward's to prefetch by."""
        self.last_iteration, self.this_iteration = self.this_iteration, []
        self.post_forward = []


class Root:
    """The per-root context: ``context``, the ``CommContext`` every collective goes through, and
    ``given``, what the user gave this ``zero.shard`` call of ``GIVEN`` (None where nothing)."""

    def __init__(self, context, given: dict):
        self.context, self.given = context, given
        self.unit: Unit = None  # type: ignore[assignment]  # the top unit: zero.shard's add()
        self.members: list = []  # every unit pointing here, as zero.shard made them
        self._units: list | None = None
        self._guard: Guard | None = None
        self._schedule: api.Schedule | None = None
        self._order: Order | None = None
        self._reductions: Reductions | None = None
        self.deferred: list = []  # stage 3: to free once their backward is surely over
        self._callback_queued = False
        self.backwards = 0  # backward passes since the root's last forward began
        self.is_last_backward = True  # False: another backward of this forward order follows

    def add(self, units: list) -> None:
        """Units this ``zero.shard`` call made; the first is the new top."""
        self.members += units
        self.unit = units[0]

    @staticmethod
    def refuse_conflicts(given: dict, below: "Root") -> None:
        """Raise unless ``below`` (to be taken over) was given the same as ``given``, or nothing."""
        where = below.unit.name if below.unit is not None else "a unit below"
        for what in GIVEN:
            theirs, ours = below.given.get(what), given.get(what)
            if theirs is not None and theirs is not ours and theirs != ours:
                said = [describe(theirs), describe(ours)]  # (no address: the ranks compare it)
                if said[0] == said[1]:  # two objects alike: say so, not "X ... sharded with X"
                    said[1] = f"another {type(ours).__name__} object, alike but not the same"
                raise ValueError(
                    f"zero.shard({where}, {what}={said[0]}): {what} is the root's to give, "
                    f"and this model's root is sharded with {what}={said[1]}. Give {what}= to "
                    "the root's zero.shard (the last call, on the whole model) only: it reaches "
                    "every unit under it, as FSDP2's units share their root's context")

    def take(self, below: "Root") -> None:
        """The units of ``below`` (a root until now) point here from now on."""
        self.context.take_names(below.context)
        for u in below.members:
            u.attach(self)
        self.members = below.members + self.members

    def share_context(self, context) -> None:
        """torch's ``share_comm_ctx``: collectives through ``context`` from now on."""
        context.take_names(self.context)
        self.context = context

    @property
    def units(self) -> list:
        """All units under the root, the root first, named by their module paths."""
        if self._units is None:
            self._units = []
            paths: dict = {}
            for path, mod in self.unit.modules[0].named_modules():
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
            self._guard = Guard([u for u in self.units if u.config.stage.frees_parameters])
        return self._guard

    @property
    def schedule(self) -> api.Schedule:
        """The schedule given to the root's ``zero.shard``, or zero's own (``prefetch``, 1)."""
        if self._schedule is None:
            given = self.given.get("schedule")
            self._schedule = given if given is not None else Schedule(
                self.given.get("prefetch") or 1)
        return self._schedule

    @property
    def order(self) -> Order:
        if self._order is None:
            self._order = Order(self.units)
        return self._order

    @property
    def reductions(self) -> Reductions:
        if self._reductions is None:
            self._reductions = Reductions(self.units, self)
        return self._reductions

    # ---- prefetching, as the schedule says ---------------------------------------------

    def forward_started(self, unit) -> None:
        """``unit`` starts its forward: record it, and prefetch."""
        if unit is self.unit:
            self.order.begin()
        self.order.this_iteration.append(unit)
        for nxt in self._prefetches(unit, "forward"):
            nxt.prefetch("forward")

    def forward_ended(self, unit) -> None:
        """``unit``'s forward is over (a backward will follow)."""
        self.order.post_forward.append(unit)

    def backward_started(self, unit) -> None:
        """``unit`` starts its backward: prefetch what the user's list or the schedule says."""
        for prev in self._prefetches(unit, "backward"):
            prev.prefetch("backward")

    def _prefetches(self, unit, phase: str) -> list:
        """The user's list, else the schedule's answer, checked and in every rank's order."""
        explicit = getattr(unit.controls, f"{phase}_prefetch")
        if explicit is not None:
            return explicit
        schedule = self.schedule
        asked = getattr(schedule, f"{phase}_prefetch")(unit, self.order)
        units = []
        for u in asked or ():  # (None: nothing)
            found = registry.unit_on(u) if isinstance(u, torch.nn.Module) else u
            if getattr(found, "root", None) is not self:
                what = f"unit {u.name}" if hasattr(u, "root") else f"{type(u).__name__} {u!r:.60}"
                raise TypeError(
                    f"the schedule {type(schedule).__name__}.{phase}_prefetch returned {what}: "
                    "it must return units of this model (members of order.units), a module "
                    "that zero.shard made a unit of, or None for none")
            if found not in units:
                units.append(found)
        rank_of = {u: i for i, u in enumerate(self.units)}  # module order: every rank's
        return sorted(units, key=lambda u: rank_of[u], reverse=phase == "backward")

    # ---- deferred frees ------------------------------------------------------------------

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

    # ---- the start of an iteration ---------------------------------------------------

    def begin_forward(self) -> None:
        """Reset what a failure left behind, agree with the other ranks, refresh the shards."""
        stuck = {u.iteration.state for u in self.units} - {TrainingState.IDLE}
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
                   group=self.unit.mesh.all_group, ctx=self.context,
                   device=self.unit.unsharded.device,
                   fix="Every rank must run the same forward and backward passes, under the same "
                       "no_sync, and the same opt.step(). A GradScaler must agree on found_inf "
                       "across ranks (zero.ShardedGradScaler); an `if finite:` guard must test a "
                       "value every rank shares (a norm from zero.clip_grad_norm_). An evaluation "
                       "forward (under torch.no_grad()) gathers parameters too: run it on every "
                       "rank, or evaluate on one rank with an unsharded copy of the model loaded "
                       "from zero.full_state_dict(model), which every rank must call")
        self.context.make_host(self.unit.mesh.all_group)  # (once: the host's group from now)
        self.backwards, self.reductions.started = 0, []
        for u in written:
            u.shard_changed()  # stages 1/2 gather the new parameters (async); stage 3 frees
        if self.unit.controls.broadcast_buffers:
            self._broadcast_buffers()

    def _since_last_forward(self, written: list) -> str:
        names = lambda units: ", ".join(u.name for u in units) or "none"  # noqa: E731
        # The order matters where collectives follow it: stage 3's gathers, stage 2/3's reductions
        ran = self.order.this_iteration or self.order.last_iteration
        order = ""
        if self.unit.config.stage.frees_parameters:
            order += f", in the order {names(ran)}"
        if not self.unit.config.stage.keep_grads:
            order += f", reduced {names(self.reductions.started)}"
        mode = "" if torch.is_grad_enabled() else " under no_grad"  # (an evaluation on one rank)
        return (f"start a forward{mode} after {self.backwards} backward(s) since the last one; "
                f"shards written (opt.step) in units: {names(written)}; units in no_sync: "
                f"{names([u for u in self.units if not u.controls.requires_grad_sync])}; the last "
                f"forward ran {len(ran)} unit(s){order}")

    def _broadcast_buffers(self) -> None:
        """DDP's ``broadcast_buffers``: rank 0's buffers everywhere, one collective per dtype."""
        buffers = [b for b in self.unit.modules[0].buffers() if b.numel()]
        for dtype in sorted({b.dtype for b in buffers}, key=str):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            # (numel,) rank 0's -> every rank's, in place
            self.context.broadcast(flat, src=0, group=self.unit.mesh.all_group, unit="root",
                                   phase="forward")
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
        self.order.this_iteration = []
        self.reductions.reset()
        self.deferred = []

    # ---- the end of backward ----------------------------------------------------------

    def queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """Runs once when the whole backward is done: end the reductions, hand out grads, free."""
        with label("root_post_backward_callback"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        synced = [u for u in self.units if u.controls.requires_grad_sync]  # the rest accumulate
        if self.is_last_backward:  # (FSDP2's set_is_last_backward(False), 1F1B pipelining:
            self.order.end()  # the next backward, of another micro-batch, prefetches by it too)
        self.reductions.finish(synced)
        self.deferred = []
        # Agree on "used", like DDP's find_unused_parameters (zero/comm/ledger.py's host note)
        used = [f for u in synced for f in u.grads.used]
        flags = work = None
        if used and not self.context.simulated(self.unit.mesh.group):
            group, device = self.context.host(self.unit.mesh.all_group)
            with comm.on_host():  # (F,) -> (F,): 1 where any rank's backward reached it
                flags = torch.tensor(used, dtype=torch.uint8, device=device)
                work = self.context.all_reduce(flags, op="max", group=group, unit="root",
                                               phase="backward", async_op=True)
        self.reductions.wait(synced)
        if work is not None and flags is not None:
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
