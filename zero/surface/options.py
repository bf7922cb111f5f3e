"""``zero.shard``'s arguments in one frozen object, handed as it is to every unit of FSDP1's
one-call form (``auto_wrap_policy``)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Options:
    """``zero.shard``'s arguments but the module (its docstring says what each does)."""

    stage: int | None = None
    group: Any = None
    mesh: Any = None
    mp_policy: Any = None
    reshard_after_forward: bool | None = None
    device: Any = None
    broadcast_buffers: bool = False
    ignored_params: Any = None
    secondary_group: Any = None
    comm_policy: Any = None
    sync_module_states: bool = False
    layout: Any = "flat"
    auto_wrap_policy: Any = None
    sharding_strategy: Any = None
    offload_policy: Any = None
    prefetch: int | None = None
    schedule: Any = None
    backend: Any = None
    shard_placement_fn: Any = None
    reduce_scatter_depth: int | None = None

    def given_to_root(self) -> dict:
        """What the root's call decides for every unit under it (``zero/core/root.py``)."""
        return {"backend": self.backend, "prefetch": self.prefetch, "schedule": self.schedule,
                "reduce_scatter_depth": self.reduce_scatter_depth}
