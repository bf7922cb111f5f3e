"""The two states a unit is in: where it is in the iteration, and what it holds of its parameters.

One enum each, members saying their transition (FSDP2's ``TrainingState`` and ``ShardedState``,
DeepSpeed's ``ZeroParamStatus``), moved by ``zero/core/hooks.py`` and ``zero/core/unit.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch


class TrainingState(enum.Enum):
    """Where a unit is in one iteration."""

    IDLE = "idle"  # between iterations, and between its forward and its backward
    FORWARD = "forward"  # from its pre-forward to its post-forward
    PRE_BACKWARD = "pre_backward"  # backward reached its output (parameters gathered again)
    POST_BACKWARD = "post_backward"  # its flat gradient is complete, till the end of backward


class ShardedState(enum.Enum):
    """What a unit holds of its parameters, besides its shard (which it always holds)."""

    SHARDED = "sharded"  # nothing more: the full flat buffer's storage is freed (0 bytes)
    # freed, but this rank keeps its slice over a smaller group (hpZ: its node; FSDP2's name)
    SHARDED_POST_FORWARD = "sharded_post_forward"
    GATHERING = "gathering"  # the full buffer is allocated, an all-gather into it in flight
    UNSHARDED = "unsharded"  # the full parameters are readable


class Held(NamedTuple):
    """What a unit holds right now (``Unit.held()``), read-only; a freed tensor has 0 bytes."""

    sharded_state: ShardedState
    training_state: TrainingState
    sharded: torch.Tensor  # this rank's shard (master dtype), always held
    unsharded: torch.Tensor  # the full flat parameters (compute dtype)
    secondary: torch.Tensor | None  # hpZ's secondary shard (SHARDED_POST_FORWARD)
    gradient: torch.Tensor | None  # autograd's full flat gradient (unsharded.grad)
    reducing: torch.Tensor | None  # the full gradient a reduce-scatter in flight reduces
    reduced: torch.Tensor | None  # the reduced gradient shard, not yet handed out
    unsynced: torch.Tensor | None  # no_sync micro-batches kept in reduce_dtype


@dataclass
class Iteration:
    """A unit's state in this iteration, written by ``zero/core/hooks.py``, made anew at its end."""

    state: TrainingState = TrainingState.IDLE
    forward_calls: int = 0  # forwards this iteration
    inputs_done: bool = False  # backward has computed the gradients of the unit's inputs
    backward_task: int = -1  # the autograd graph task that reached the unit's outputs
    views: list | None = None  # the views into the gathered buffer the module computes with
    views_for: tuple = ()  # which parameters required grad when those views were made
    method: object = None  # the frame of a method registered as a forward, while it runs


@dataclass
class Controls:
    """The user's settings for a unit (FSDP2's controls: ``zero/surface/controls.py``)."""

    reshard_after_forward: bool | None = None  # stage 3; None: decided by the unit's role
    reshard_after_backward: bool = True  # False: keep gathered for the next micro-batch
    requires_grad_sync: bool = True  # False: accumulate unsynced (no_sync)
    pinned: bool = False  # zero.unshard(module): gathered until zero.reshard(module)
    unshard_in_backward: bool = True  # False: backward reads no parameter (an embedding's)
    forward_prefetch: list | None = None  # explicit lists; None: the schedule's own order
    backward_prefetch: list | None = None
    broadcast_buffers: bool = False  # the root: rank 0's buffers before each forward
    # FSDP2's six gradient settings (read by the unit's ``Gradient``, zero/core/grads.py)
    divide_factor: float | None = None  # set_gradient_divide_factor
    force_sum: bool = False  # set_force_sum_reduction_for_comms
    requires_all_reduce: bool = True  # False skips HSDP's all-reduce (grads.py's note)
    all_reduce_hook: tuple[Callable, Any] | None = None  # set_all_reduce_hook: (hook, stream)
    reduce_unused: bool = False  # set_reduce_scatter_unused_params
    max_in_flight: int = 1  # set_reduce_scatter_max_input_buffers (zero/core/reductions.py)
