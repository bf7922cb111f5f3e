"""The three stages are one mechanism with a policy, and this table is the whole policy.

ZeRO (Rajbhandari et al., SC20, section 5) shards, stage by stage, the optimizer state
(P_os), then the gradients (P_os+g), then the parameters (P_os+g+p). In our mechanism
(``zero/unit.py``) every stage already shards the optimizer state, because the optimizer only
ever sees this rank's pieces; what the stage decides is which full tensors a rank keeps:
the parameters between steps, and the gradient until the step. Every stage reduce-scatters a
unit's gradient as soon as it is complete.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """What differs between the stages: the whole table is these two booleans.

    | stage | keep_params                       | keep_grads                                   |
    |-------|-----------------------------------|----------------------------------------------|
    | 1     | full params live between steps    | full gradient until the step (each unit's    |
    |       |                                   | shard reduced in place into its own slot)    |
    | 2     | full params live between steps    | no: each unit's freed once it is reduced     |
    | 3     | no: gathered for forward/backward | no                                           |
    """

    number: int
    keep_params: bool
    keep_grads: bool


STAGES = {1: Stage(1, True, True), 2: Stage(2, True, False), 3: Stage(3, False, False)}
