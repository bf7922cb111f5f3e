"""What ``zero.shard`` is told, in one object: ``Options``, and how the ranks compare it.

``zero.shard`` takes FSDP2's and FSDP1's arguments by name (its docstring lists them); they
are gathered here into one frozen object that the rest of the call reads, so that no function
of it takes a dozen loose arguments, and so that FSDP1's one-call form (``auto_wrap_policy``,
``sharding_strategy``) can hand the same options to every unit it makes. ``describe`` is how
the ranks compare a policy object before the first collective: by its class and fields, never
by an address that differs from rank to rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False)
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

    def but(self, **changes) -> "Options":
        """The same options with ``changes``."""
        return dataclasses.replace(self, **changes)

    def given_to_root(self) -> dict:
        """What the root's call decides for every unit under it (``zero/core/root.py``)."""
        return {"backend": self.backend, "prefetch": self.prefetch, "schedule": self.schedule}


def describe(obj, depth: int = 0) -> str:
    """``obj`` as the ranks compare it: its own ``repr`` if its class wrote one, else its
    class and its fields, described alike (an object with Python's default ``repr``, which
    shows its address, is the same on every rank that built it the same way)."""
    if obj is None or isinstance(obj, (str, int, float, bool, tuple, type)):
        return repr(obj)
    cls = type(obj)
    if cls.__repr__ is not object.__repr__:
        return repr(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    fields = getattr(obj, "__dict__", None)
    if not fields or depth >= 2:
        return name
    return f"{name}({', '.join(f'{k}={describe(v, depth + 1)}' for k, v in sorted(fields.items()))})"
