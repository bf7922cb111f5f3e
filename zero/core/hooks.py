"""The life of a unit in one iteration: four hooks, and the state a unit is in between them.

FSDP2's four, same names: ``pre_forward`` gathers (stage 3) and computes with views,
``post_forward`` frees (stage 3) and hooks the outputs, ``pre_backward`` gathers again,
``post_backward`` reduce-scatters the complete flat gradient (notes/05-stage3.md, "The life of
a unit in one step"). The only file that hooks a unit and moves its ``TrainingState``
(notes/12-model-code.md, "One state per unit").

[Note: frozen parameters] A frozen weight gives no gradient but is read for the input's: at
stage 3 a unit with frozen parameters frees them once its inputs' gradients exist
(``_InputGradients``), as FSDP2 (notes/18-edge-cases.md, "Frozen parameters").

[Note: a gradient completed inside a recompute] Under reentrant checkpointing a stage-3 unit's
gradient may complete in a recompute's backward (not ``backward_task``) while the outer one still
needs the parameters: freed at the next unit's backward or recompute, or at backward's end
(``Root.free_deferred``).
"""

from __future__ import annotations

import sys
import weakref
from functools import partial
from types import FrameType
from typing import Any

import torch
import torch.nn as nn

from zero.comm.context import label
from zero.core import adoption, guards
from zero.core.root import root_of
from zero.core.state import ShardedState, TrainingState as State
from zero.core.tree import map_tensors, tensors_in


def install(unit) -> None:
    """Hook the unit's modules (``pre_forward``, ``post_forward``); the other two go on tensors."""
    for m in unit.modules:
        m.register_forward_pre_hook(partial(pre_forward, unit), with_kwargs=True)
        m.register_forward_hook(partial(post_forward, unit))


def in_backward() -> bool:
    """True while autograd's engine runs a backward (e.g. activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def pre_forward(unit, module: nn.Module, args: Any, kwargs: Any):
    with label("pre_forward", unit.name):  # (each hook a profiler range: context.py's note)
        return _pre_forward(unit, module, args, kwargs)


def post_forward(unit, module: nn.Module, args: Any, output: Any) -> Any:
    with label("post_forward", unit.name):
        return _post_forward(unit, module, args, output)


def pre_backward(unit, grad: torch.Tensor) -> None:
    with label("pre_backward", unit.name):
        _pre_backward(unit, grad)


def post_backward(ref: weakref.ref, leaf: torch.Tensor) -> None:
    """The flat gradient is complete. (Weak: a tensor's hook would keep a deleted model.)"""
    unit = ref()
    if unit is not None:
        with label("post_backward", unit.name):
            _post_backward(unit, leaf)


def _pre_forward(unit, module: nn.Module, args: Any, kwargs: Any):
    root = root_of(unit)
    if unit.config.cast_inputs:
        args, kwargs = map_tensors(unit.cast, (args, kwargs))
    if in_forward_method(unit):  # inside a method run as its forward: gathered, viewed
        return args, kwargs
    if in_backward():  # activation-checkpoint recompute: gathered for backward
        root.free_deferred(but=unit)
        unit.unshard(phase="backward")
        unit.iteration.state = State.PRE_BACKWARD
    else:
        if unit.parent is None:
            root.begin_forward()  # reset what a failure left behind, agree, refresh
        unit.adopt_replaced()  # a parameter a client swapped in (setattr) since the last one
        guards.converted_after_sharding(unit)
        if (unit.config.stage.keep_params and unit.sharded_state is ShardedState.UNSHARDED
                and unit.shard_written()):
            unit.shard_changed()  # called on its own, not from the root's forward
        unit.grads.discard_if_zeroed()
        unit.iteration.state = State.FORWARD
        unit.iteration.forward_calls += 1
        unit.unshard(phase="forward", async_op=True)
        root.forward_started(unit)  # prefetches what the schedule says: the next unit
        unit.wait_unshard()
        if torch.is_grad_enabled():
            if unit.reshard_after_forward:
                root.guard.enter()
            if (unit.config.stage.frees_parameters
                    and not all(p.requires_grad for p in unit.params)):
                args, kwargs = _hook_input_gradients(unit, args, kwargs)
    use_unsharded_views(unit)
    return args, kwargs


def _post_forward(unit, module: nn.Module, args: Any, output: Any) -> Any:
    if unit.config.output_dtype is not None:  # (a recompute too: reentrant backward: dtypes)
        output = map_tensors(unit.cast_output, output)
    if in_backward() or in_forward_method(unit):
        return output  # a recompute (backward still needs everything), or inside a method
    if unit.reshard_after_forward and torch.is_grad_enabled():
        root_of(unit).guard.exit()
    guards.replaced_in_forward(unit)
    unit.use_sharded_params()
    unit.iteration.state = State.IDLE
    last = unit.iteration.forward_calls % len(unit.modules) == 0  # (zero.shard([a, b]): all ran)
    if not torch.is_grad_enabled():
        if last:
            unit.reshard()  # no backward will come for this forward
        return output
    if last:
        root_of(unit).forward_ended(unit)  # (backward prefetches in the order forwards end)
    if unit.reshard_after_forward and last:
        unit.reshard(after_forward=True)  # hpZ: backward gathers within the node
    for t in tensors_in(output):
        if t.requires_grad:
            t.register_hook(lambda grad: pre_backward(unit, grad))
    return output


def _pre_backward(unit, grad: torch.Tensor) -> None:
    if unit.iteration.state is not State.PRE_BACKWARD:  # the first of its outputs reached
        adoption.refuse_before_backward(unit)  # a parameter replaced since forward
        root = root_of(unit)
        root.free_deferred(but=unit)
        unit.iteration.backward_task = torch._C._current_graph_task_id()
        unit.iteration.state = State.PRE_BACKWARD
        gather = unit.controls.unshard_in_backward  # (FSDP2's set_unshard_in_backward)
        if gather:
            unit.unshard(phase="backward", async_op=True)
        root.queue_final_callback()
        root.backward_started(unit)  # prefetches what the schedule says: the unit before
        if gather:
            unit.wait_unshard()
            use_unsharded_views(unit)  # for a recompute inside the unit's forward


def _post_backward(unit, leaf: torch.Tensor) -> None:
    root = root_of(unit)
    root.queue_final_callback()
    unit.iteration.state = State.POST_BACKWARD
    if not unit.controls.requires_grad_sync:
        unit.grads.keep_unsynced()
    elif unit.config.stage.reduces_when_complete(unit.grads.keeps_full):
        root.reductions.reduce(unit)  # (stage 1 through a cast waits for the end of backward)
    if unit.config.stage.keep_params:
        return  # (the end of backward swaps back: a checkpointed piece may still recompute)
    if all(p.requires_grad for p in unit.params) or unit.iteration.inputs_done:  # (frozen: note)
        if torch._C._current_graph_task_id() != unit.iteration.backward_task:
            root.defer_reshard(unit)  # completed in a recompute's backward: module note
        else:
            unit.release_after_backward()


# ---- a method run as a forward (FSDP2's register_fsdp_forward_method) ----------------------

def pre_forward_method(unit, module: nn.Module, args: Any, kwargs: Any, frame):
    """A method (``generate``) runs as the unit's forward; ``frame`` marks the unit meanwhile."""
    outer = in_forward_method(unit)
    args, kwargs = pre_forward(unit, module, args, kwargs)
    if not outer:
        unit.iteration.method = frame
    return args, kwargs


def post_forward_method(unit, module: nn.Module, args: Any, output: Any, frame) -> Any:
    if unit.iteration.method is frame:
        unit.iteration.method = None
    return post_forward(unit, module, args, output)


def in_forward_method(unit) -> bool:
    """Whether a method run as the unit's forward is running (its frame is on the stack)."""
    frame = unit.iteration.method
    if frame is None:
        return False
    f: FrameType | None = sys._getframe(1)
    while f is not None and f is not frame:
        f = f.f_back
    if f is None:  # stale: the method raised, and torch called no post-forward
        unit.iteration.method = None
    return f is not None


# ---- the views the module computes with, and their autograd hooks --------------------------

def use_unsharded_views(unit) -> None:
    """Compute with views into ``unsharded``, made once per iteration (notes/12)."""
    wants = tuple(p.requires_grad for p in unit.params)
    it = unit.iteration
    if it.views is None or it.views_for != wants:  # new iteration, or (un)frozen
        it.views, it.views_for = _make_views(unit, wants), wants
    unit.use(it.views)


def _make_views(unit, wants: tuple[bool, ...]) -> list[torch.Tensor]:
    if unit.unsharded.requires_grad != any(wants):  # a parameter was (un)frozen
        unit.unsharded.requires_grad_(any(wants))
    if any(wants) and unit.post_backward_handle is None:
        unit.post_backward_handle = unit.unsharded.register_post_accumulate_grad_hook(
            partial(post_backward, weakref.ref(unit)))
    views = []
    # (under no_grad too: a later forward may reuse the views)
    with torch.inference_mode(False), torch.enable_grad():
        for i, v in enumerate(unit.layout.views(unit.unsharded)):
            if not wants[i]:
                v = v.detach()  # frozen: no gradient is computed for it
            elif v.requires_grad:
                v.register_hook(partial(unit.grads.mark_used, i))
            views.append(unit.sharded_params[i].unsharded(v))  # (a DTensor under TP, say)
    return views


class _InputGradients(torch.autograd.Function):
    """The identity on a unit's inputs; its backward runs when their gradients are computed."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        if unit.iteration.forward_calls == 1:  # called twice: the other's backward may be due
            unit.iteration.inputs_done = True
            if unit.iteration.state is State.POST_BACKWARD or not unit.unsharded.requires_grad:
                unit.release_after_backward()
        return (None, *grads)


def _hook_input_gradients(unit, args, kwargs):
    inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not inputs:
        return args, kwargs  # (data, say): the end of backward frees the unit instead
    hooked = dict(zip(map(id, inputs), _InputGradients.apply(unit, *inputs)))
    return map_tensors(lambda t: hooked.get(id(t), t), (args, kwargs))
