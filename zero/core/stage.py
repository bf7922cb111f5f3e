"""The three stages are one mechanism with a policy, and this table is the whole policy.

ZeRO (Rajbhandari et al., SC20, section 5) shards P_os, then P_os+g, then P_os+g+p; here
every stage shards the optimizer state, and the stage decides which full tensors a rank keeps.
Every rule the mechanism follows is derived here (notes/04-stage2.md, "One line in the table").
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
        """Stages 1/2 without a cast: the shard inside the full buffer (Ψ, not Ψ + Ψ/N)."""
        return self.keep_params and param_dtype == master_dtype

    def keeps_full_gradient(self, param_dtype, reduce_dtype, master_dtype) -> bool:
        """Stage 1 keeps the full gradient, reduced in place; not through a cast: then it keeps
        each bf16 gradient whole until backward ends (the paper's 2Ψ) and reduces fp32 copies."""
        return self.keep_grads and reduce_dtype == param_dtype and reduce_dtype == master_dtype

    def reduces_when_complete(self, keeps_full_gradient: bool) -> bool:
        """Reduce as soon as the gradient is complete (else at the end of backward)."""
        return keeps_full_gradient or not self.keep_grads

    def reshards_after_forward(self, setting: bool | None, is_root: bool) -> bool:
        """Stage 3: as set, else (None) every unit but the root, as FSDP2; never at 1/2."""
        if self.keep_params:
            return False
        return not is_root if setting is None else setting


STAGES = {1: Stage(1, True, True), 2: Stage(2, True, False), 3: Stage(3, False, False)}
