"""Memory trackers: torch's MemTracker taught where our tensors are, and per-category peaks.

``ZeroMemTracker`` is torch's ``MemTracker`` taught where our tensors are: a unit's flat
buffers are parameters, the flat gradient arriving at the leaf and every reduce-scatter
output are gradients. It also keeps each category's own peak, which MemTracker does not
(its peak snapshot is the moment of the largest *total*). The paper's formulas it is
compared with are in ``zerolab/memory.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType

from zero import units_of
from zero.comm import host_side

_RS = torch.ops.c10d._reduce_scatter_base_.default
# A comm policy's own buffers on the wire (qwZ's quantized message, qgZ's all-to-all, a custom
# FSDP2 AllGather's): comm buffers, as FSDP2's tracker files its all-gather and reduce-scatter
# buffers. The default policy sends the units' own storage, which stays a model state.
_WIRE = {torch.ops.c10d._allgather_base_.default: _FSDPRefType.ALL_GATHER,
         _RS: _FSDPRefType.REDUCE_SCATTER,
         torch.ops.c10d.alltoall_base_.default: _FSDPRefType.REDUCE_SCATTER}
_COPY = torch.ops.aten._to_copy.default
_CLONE = torch.ops.aten.clone.default


# Categories that are model states, in MemTracker's and FSDPMemTracker's names.
OPTIMIZER_CATEGORIES = {"Optstate", "OptState"}
MODEL_STATE_CATEGORIES = {"Parameter", "Gradient", "Sharded Param", "Unsharded Param",
                          "Sharded Grad", "Unsharded Grad", *OPTIMIZER_CATEGORIES}
COMM_CATEGORIES = {"All Gather", "Reduce Scatter"}  # FSDP2's copies of units in flight
MODEL_STATES = "Model states"  # the key of the peak of parameters + gradients + optimizer state
MODEL_STATES_AND_COMM = "Model states + comm buffers"


class CategoryPeaks:
    """Mixin for any MemTracker: ``category_peaks[device][category]``, each category's own peak,
    and two peaks that compare systems alike:

    - ``MODEL_STATES``: parameters + gradients + optimizer *state*, the ZeRO paper's model
      states. While ``optimizer.step()`` runs, the optimizer category also holds the step's
      temporaries (AdamW's denominators); those are not state, so the peak keeps counting the
      optimizer state as it was when the step began.
    - ``MODEL_STATES_AND_COMM``: the same plus FSDP2's communication buffers, which hold the
      units it has in flight (all-gather outputs, reduce-scatter inputs). Ours gather into and
      reduce out of the parameter and gradient storage itself, so our units in flight are in
      the first peak already; FSDPMemTracker files FSDP2's here.

    MemTracker's own peak is one snapshot, taken at the moment of the largest *total*; the
    question "how many gradient bytes at most?" needs each category's maximum over time.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.category_peaks: dict[torch.device, dict[Any, int]] = {}
        self._optimizer_state: dict[torch.device, int] = {}  # outside the step

    def _update_snap(self, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(*args, **kwargs)
        for dev, snap in self._curr_mem_snap.items():
            peaks = self.category_peaks.setdefault(dev, {})
            by_name = {getattr(c, "value", c): v for c, v in snap.items()}
            for cat, nbytes in snap.items():
                peaks[cat] = max(peaks.get(cat, 0), nbytes)
            opt = sum(v for c, v in by_name.items() if c in OPTIMIZER_CATEGORIES)
            if not self._in_opt:
                self._optimizer_state[dev] = opt
            states = sum(v for c, v in by_name.items()
                         if c in MODEL_STATE_CATEGORIES and c not in OPTIMIZER_CATEGORIES)
            states += self._optimizer_state.get(dev, opt)
            comm = sum(v for c, v in by_name.items() if c in COMM_CATEGORIES)
            peaks[MODEL_STATES] = max(peaks.get(MODEL_STATES, 0), states)
            peaks[MODEL_STATES_AND_COMM] = max(peaks.get(MODEL_STATES_AND_COMM, 0), states + comm)


class PeakMemTracker(CategoryPeaks, MemTracker):
    """torch's MemTracker with per-category peaks (for DDP and ZeroRedundancyOptimizer).

    MemTracker hooks every parameter's gradient and fails on a frozen one ("cannot register a
    hook on a tensor that doesn't require gradient"): hook only the trainable ones.
    """

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        for p in module.parameters():
            if install_grad_hooks and p.requires_grad and p not in self._param_to_grad_hook_handles:
                def grad_hook(grad):
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)
                self._param_to_grad_hook_handles[p] = (
                    p.register_hook(grad_hook),
                    p.register_post_accumulate_grad_hook(lambda q: grad_hook(q.grad)))
        return memory


class PeakFSDPMemTracker(CategoryPeaks, FSDPMemTracker):
    """torch's FSDPMemTracker (for FSDP2) with per-category peaks."""


class ZeroMemTracker(CategoryPeaks, MemTracker):
    """MemTracker for a model sharded with ``zero.shard`` (used like FSDPMemTracker).

    Besides MemTracker's categories it splits what it sees the way the ZeRO paper does:
    *model states* (the shards, stages 1/2's full compute copy, the gradients at their
    largest: full for stage 1, sharded for 2/3, the optimizer state) and *transient*
    bytes that live only for a while (stage 3's unsharded units, stages 2/3's full flat
    gradient of a unit until it is reduced, mixed precision's upcast reduce buffer).

    Example::

        with ZeroMemTracker(model, optimizer) as mt:
            train_step()
        mt.get_tracker_snapshot("peak")      # MemTracker's snapshot at the peak total
        mt.category_peaks[dev][_MemRefType.GRAD]   # the gradients' own peak
        mt.model_states_peak, mt.transient_peak      # bytes, the paper's split
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 per_module: bool = True):
        super().__init__()
        self._model, self._optimizer = model, optimizer
        self._per_module = per_module  # False: skip per-module peaks (big models, simulations)
        self._handles: list[Any] = []
        self._transient: dict[int, Any] = {}  # id -> MemTracker's record of a transient storage
        self.state_peaks: dict[Any, int] = {}  # PARAM, GRAD, OPT: each one's peak, less transients
        self.transient_peak = 0
        self._quiet = False
        # MemTracker's categories, and FSDP2's two for buffers on the wire (_WIRE)
        self._ref_class = [*_MemRefType, *set(_WIRE.values())]  # type: ignore[assignment]

    def __enter__(self) -> "ZeroMemTracker":
        super().__enter__()
        self.track_external(self._model, self._optimizer)
        for unit in units_of(self._model):
            held = unit.held()
            # stage 3's unsharded parameters are transient; stages 1/2 keep theirs
            self._tag(held.unsharded, _MemRefType.PARAM, unit.config.stage.frees_parameters)
            self._tag(held.sharded, _MemRefType.PARAM, transient=False)
            if held.unsharded.requires_grad:  # the flat gradient, before it is accumulated
                self._handles.append(held.unsharded.register_hook(partial(self._tag_grad, unit)))
            # (a unit whose parameters are all frozen has no flat gradient to tag)
        return self

    def __exit__(self, *args: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._update_split()  # the optimizer state as the last step left it
        super().__exit__(*args)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        # MemTracker hooks every parameter's gradient, which fails on a frozen one and never
        # fires on ours (autograd fills the unit's flat leaf; we tag those gradients
        # ourselves), so: no gradient hooks. Inside a unit's forward the parameters are views
        # into its flat buffer, not leaves; __enter__ tracked that buffer already.
        def total(tensors, reftype):
            return sum(w.mem_consumed for t in tensors
                       for w in self._update_and_maybe_create_winfos(t, reftype))
        for p in module.parameters():
            if p.is_leaf and p.grad is not None:  # (inside forward: views, no .grad)
                self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)
        return total(module.parameters(), _MemRefType.PARAM), total(module.buffers(),
                                                                    _MemRefType.BUFFER)

    def _tag_grad(self, unit, grad: torch.Tensor) -> None:
        # Stages 2/3 reduce a unit's full gradient and free it during backward: transient.
        self._tag(grad, _MemRefType.GRAD, transient=not unit.config.stage.keep_grads)

    def _tag(self, t: torch.Tensor, reftype, transient: bool) -> None:
        self._quiet = True  # no split in between: it would count a transient as a state
        self._update_and_maybe_create_winfos(t, reftype)
        self._quiet = False
        if transient:
            for st in get_untyped_storages(t):
                winfo = self._WINFO[st][0]
                self._transient[id(winfo)] = winfo
        self._update_split()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = super().__torch_dispatch__(func, types, args, kwargs)
        if func is _COPY and self._is_transient(args[0]):  # an upcast of a unit's gradient
            self._tag(res, _MemRefType.TEMP, transient=True)
        if func is _CLONE and self._is_transient(args[0]):
            if self._is_kind(args[0], _MemRefType.PARAM):  # hpZ's secondary shard, kept
                self._tag(res, _MemRefType.PARAM, transient=True)  # from forward to backward
            else:  # a gradient shard copied out of a full gradient (or of its upcast copy)
                self._tag(res, _MemRefType.GRAD, transient=False)
        if func is _RS and self._is_transient(args[1]) and not self._is_grad(args[1]):
            self._tag(args[1], _MemRefType.TEMP, transient=True)  # an upcast made for it
        if func in _WIRE and not host_side():  # (the agreement's few bytes are the host's)
            for t in args[:2]:
                if isinstance(t, torch.Tensor) and self._made_for_the_wire(t):
                    self._tag(t, _WIRE[func], transient=True)
        return res

    def _made_for_the_wire(self, t: torch.Tensor) -> bool:
        """A buffer made by the step (not a state, not already tagged), then sent."""
        kinds = {self._WINFO[st][0].reftype for st in get_untyped_storages(t) if st in self._WINFO}
        return bool(kinds) and kinds <= {_MemRefType.ACT, _MemRefType.TEMP} \
            and not self._is_transient(t)

    def _update_peak_stats(self, peak_state) -> None:
        if self._per_module:  # MemTracker walks every module's stats after every op
            return super()._update_peak_stats(peak_state)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def _is_transient(self, t: torch.Tensor) -> bool:
        return any(id(self._WINFO[st][0]) in self._transient for st in get_untyped_storages(t)
                   if st in self._WINFO)

    def _is_grad(self, t: torch.Tensor) -> bool:
        return self._is_kind(t, _MemRefType.GRAD)

    def _is_kind(self, t: torch.Tensor, reftype) -> bool:
        return all(self._WINFO[st][0].reftype == reftype for st in get_untyped_storages(t))

    def _update_snap(self, u_type, winfo, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if u_type == _UpdateType.DEL:
            self._transient.pop(id(winfo), None)
        if not self._quiet:
            self._update_split()

    def _update_split(self) -> None:
        transient = list(self._transient.values())
        self.transient_peak = max(self.transient_peak, sum(w.mem_consumed for w in transient))
        for cat in _STATE_TYPES:
            if cat == _MemRefType.OPT and self._in_opt:
                continue  # the step's temporaries are not state: count what survives it
            now = sum(snap.get(cat, 0) for snap in self._curr_mem_snap.values())
            now -= sum(w.mem_consumed for w in transient if w.reftype == cat)
            self.state_peaks[cat] = max(self.state_peaks.get(cat, 0), now)

    @property
    def model_states_peak(self) -> int:
        """Parameters + gradients + optimizer state, each at its own (persistent) peak."""
        return sum(self.state_peaks.values())


_STATE_TYPES = (_MemRefType.PARAM, _MemRefType.GRAD, _MemRefType.OPT)
