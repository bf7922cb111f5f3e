"""The three stages are one mechanism with a policy, and this table is the whole policy.

ZeRO (Rajbhandari et al., SC20, section 5) shards, stage by stage, the optimizer state
(P_os), then the gradients (P_os+g), then the parameters (P_os+g+p). In our mechanism
(``zero/core/unit.py``) every stage already shards the optimizer state, because the optimizer
only ever sees this rank's pieces; what the stage decides is which full tensors a rank keeps:
the parameters between steps, and the gradient until the step. Every stage reduce-scatters a
unit's gradient as soon as it is complete, but stage 1 in mixed precision, which keeps every
low-precision gradient whole until the end of backward (``keeps_full_gradient``).

Every rule the mechanism follows is derived here, from the two booleans and the unit's dtypes,
so that nothing else consults the table directly but to ask one of these questions.
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

    @property
    def frees_parameters(self) -> bool:
        """Stage 3: the full parameters exist only while a unit computes."""
        return not self.keep_params

    def shards_in_place(self, param_dtype, master_dtype) -> bool:
        """Stages 1/2 without a cast: the shard lives inside the full buffer, so the
        all-gather after each step happens in place and parameters cost Ψ, not Ψ + Ψ/N."""
        return self.keep_params and param_dtype == master_dtype

    def keeps_full_gradient(self, param_dtype, reduce_dtype, master_dtype) -> bool:
        """Stage 1 keeps the full gradient until the step and reduces it in place, into its
        own slot, as soon as it is complete. Not through a cast: a bf16 gradient is reduced
        through an fp32 copy, after which it would serve nothing; so in mixed precision stage
        1 keeps every bf16 gradient whole until backward ends (the paper's 2Ψ), then reduces
        them one by one."""
        return self.keep_grads and reduce_dtype == param_dtype and reduce_dtype == master_dtype

    def reduces_when_complete(self, keeps_full_gradient: bool) -> bool:
        """Whether a unit's reduce-scatter starts as soon as its gradient is complete (else:
        at the end of backward, stage 1 through a cast)."""
        return keeps_full_gradient or not self.keep_grads

    def reshards_after_forward(self, setting: bool | None, is_root: bool) -> bool:
        """Free the parameters between forward and backward? Never at stages 1/2; at stage 3
        as set, and by default (None) for every unit but the root (FSDP2: the root keeps
        its parameters, which backward needs first)."""
        if self.keep_params:
            return False
        return not is_root if setting is None else setting


STAGES = {1: Stage(1, True, True), 2: Stage(2, True, False), 3: Stage(3, False, False)}
