"""Running statistics drift apart across ranks unless someone keeps them together: say so
(notes/13-agreement.md, "zero_grad, state_dict, buffers: DDP's habits")."""

from __future__ import annotations

import warnings


def warn_if_they_drift(top) -> None:
    """Warn once if the root unit ``top``'s model has running statistics and no broadcast."""
    if top.controls.broadcast_buffers or top.root.context.world_size(top.mesh.all_group) < 2:
        return
    tracked = [name for name, m in top.modules[0].named_modules()
               if getattr(m, "track_running_stats", False)
               and getattr(m, "running_mean", None) is not None]
    if not tracked:
        return
    warnings.warn(
        f"{', '.join(tracked[:3])}{', ...' if len(tracked) > 3 else ''}: running statistics "
        "(BatchNorm, InstanceNorm with track_running_stats) are updated by each rank from "
        "its own batch and drift apart across ranks, as with FSDP2 (DDP broadcasts rank 0's "
        "buffers before every forward). Pass broadcast_buffers=True to the root's zero.shard "
        "call to do as DDP does; with zero.fully_shard (FSDP2's arguments, no such option), "
        "broadcast or average them yourself before you evaluate or save", stacklevel=2)
