"""The two states a unit is in: where it is in the iteration, and what it holds of its parameters.

Each is one enum whose members say their transition (FSDP2's ``TrainingState`` and
``ShardedState``, DeepSpeed's ``ZeroParamStatus``), instead of flags that could contradict
each other. ``zero/core/hooks.py`` moves a unit through ``TrainingState``;
``zero/core/unit.py`` moves it through ``ShardedState``.
"""

from __future__ import annotations

import enum


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
