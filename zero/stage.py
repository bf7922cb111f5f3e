"""The three stages are one mechanism with a policy, and this table is the whole policy.

ZeRO (Rajbhandari et al., SC20, section 5) shards, stage by stage, the optimizer state
(P_os), then the gradients (P_os+g), then the parameters (P_os+g+p). In our mechanism
(``zero/unit.py``) every stage already shards the optimizer state, because the optimizer only
ever sees this rank's pieces; what the stage decides is *when* the full parameters exist and
*when* a unit's gradient is reduced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """What differs between the stages: the whole table is these two booleans.

    | stage | keep_params                       | reduce_each_unit                     |
    |-------|-----------------------------------|--------------------------------------|
    | 1     | full params live between steps    | no: all units at the end of backward |
    | 2     | full params live between steps    | yes: as soon as a unit's grad is done |
    | 3     | no: gathered for forward/backward | yes                                  |
    """

    number: int
    keep_params: bool
    reduce_each_unit: bool


STAGES = {1: Stage(1, True, False), 2: Stage(2, True, True), 3: Stage(3, False, True)}
