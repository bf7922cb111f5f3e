"""Running statistics drift apart across ranks unless someone keeps them together: say so.

BatchNorm (and InstanceNorm with ``track_running_stats=True``) updates ``running_mean`` and
``running_var`` in every training forward, from this rank's batch. Nothing reduces them, so
each rank's copy follows its own data, and an evaluation or a checkpoint reads one rank's
(the issue's case: eval outputs 0.035 apart after 3 steps, 2 ranks). DDP broadcasts rank 0's
buffers before every forward (its ``broadcast_buffers=True`` default); FSDP2 does not, and
neither does zero unless asked (``zero.shard(model, broadcast_buffers=True)``, the root's
call). The default stays FSDP2's, which costs nothing, but the root's first forward warns
once when a model holds such statistics and nothing keeps them together.
"""

from __future__ import annotations

import warnings


def warn_if_they_drift(top) -> None:
    """Warn once (at the root's lazy init) if the model of ``top`` (the root unit) has
    running statistics, ranks to differ on, and no broadcast of its buffers."""
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
