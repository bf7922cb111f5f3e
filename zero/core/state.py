"""The two states a unit is in: where it is in the iteration, and what it holds of its parameters.

Each is one enum whose members say their transition (FSDP2's ``TrainingState`` and
``ShardedState``, DeepSpeed's ``ZeroParamStatus``), instead of flags that could contradict
each other. ``zero/core/hooks.py`` moves a unit through ``TrainingState``;
``zero/core/unit.py`` moves it through ``ShardedState``. ``Held`` is what a unit shows an
observer of both (``Unit.held()``).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch


class TrainingState(enum.Enum):
    """Where a unit is in one iteration.

    IDLE           between iterations, and between its forward and its backward
    FORWARD        from its pre-forward to its post-forward
    PRE_BACKWARD   from the moment backward reaches its output (parameters gathered again)
    POST_BACKWARD  from the moment its flat gradient is complete to the end of backward
    """

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class ShardedState(enum.Enum):
    """What a unit holds of its parameters, besides its shard (which it always holds).

    SHARDED    nothing more: the full flat buffer's storage is freed (0 bytes)
    SECONDARY  hpZ: freed, but this rank keeps its slice of the parameters over its node
               (a secondary shard), from which backward gathers within the node
    GATHERING  the full buffer is allocated and an all-gather into it is in flight
    UNSHARDED  the full parameters are readable
    """

    SHARDED = "sharded"
    SECONDARY = "secondary"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Held(NamedTuple):
    """What a unit holds right now (``Unit.held()``): read them, never write them.

    A freed tensor is still there, with a storage of 0 bytes.
    """

    sharded_state: ShardedState
    training_state: TrainingState
    sharded: torch.Tensor  # this rank's shard (master dtype), always held
    unsharded: torch.Tensor  # the full flat parameters (compute dtype)
    secondary: torch.Tensor | None  # hpZ's secondary shard, between forward and backward
    gradient: torch.Tensor | None  # autograd's full flat gradient (unsharded.grad)
    reducing: torch.Tensor | None  # the full gradient a reduce-scatter in flight reduces
    reduced: torch.Tensor | None  # the reduced gradient shard, not yet handed out
    unsynced: torch.Tensor | None  # no_sync micro-batches kept in reduce_dtype
