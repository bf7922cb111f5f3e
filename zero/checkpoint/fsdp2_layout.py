"""FSDP2's per-parameter layout, and moving one unit's flat shard to it and back.

[Note: two layouts of the same numbers]
Ours (``zero/core/flat.py``) cuts a *unit*'s buffer into N equal slices; FSDP2's cuts each
*parameter* along dim 0 like ``torch.chunk``, a ``Shard(0)`` DTensor (a 0-d one: whole on every
rank). Moving between them takes one all-gather of the unit: notes/08-checkpoints.md, "What is
on disk" and "Moving one unit between the two layouts".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zero import comm


@dataclass(frozen=True)
class Chunk:
    """Rank r's FSDP2 chunk of one parameter: flattened elements ``[start, stop)``."""

    start: int
    stop: int
    shape: torch.Size  # (rows, *shape[1:]); () for a 0-d parameter
    padded: int  # c rows' worth of elements: what every rank sends for it in an all-gather
    rows: tuple[int, int] | None = None  # rows [first, end) of dim 0; None for a 0-d one


def chunk_of(shape: torch.Size, world_size: int, rank: int) -> Chunk:
    """This rank's dim-0 chunk of a parameter of ``shape`` (``torch.chunk``'s arithmetic)."""
    if len(shape) == 0:
        return Chunk(0, 1, torch.Size(), padded=0)  # replicated: nothing to gather
    rows, row = shape[0], shape[1:].numel()
    c = -(-rows // world_size)
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    return Chunk(lo * row, hi * row, torch.Size([hi - lo, *shape[1:]]), c * row, (lo, hi))


def to_dtensor(chunk: torch.Tensor, shape: torch.Size, mesh: DeviceMesh) -> torch.Tensor:
    """Wrap this rank's chunk as the ``Shard(0)`` DTensor FSDP2 would hold (0-d: as is)."""
    if len(shape) == 0:
        return chunk
    stride = torch.empty(shape, device="meta").stride()
    # Uneven chunks: the global shape and stride must be given, DTensor cannot infer them.
    return DTensor.from_local(chunk, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def mesh_of(unit) -> DeviceMesh:
    """A 1-D mesh over the unit's process group (no new communicator: notes/15)."""
    group = unit.group or unit.root.context.backend.world()
    return DeviceMesh.from_group(group, unit.sharded.device.type)


def flat_to_chunks(unit, shard: torch.Tensor) -> list[torch.Tensor]:
    """(S,) ``unit.sharded`` (or laid out like it) -> this rank's FSDP2 chunk of each param."""
    layout = unit.layout
    if layout.padded_numel == 0:
        return []
    flat = shard.new_empty(layout.padded_numel)
    # (S,) per rank -> (N*S,): the whole unit, transient
    comm.all_gather(flat, shard, group=unit.group, unit=unit.name, phase="other",
                    ctx=unit.root.context)
    chunks = []
    for shape, whole in zip(layout.shapes, layout.views(layout.from_wire(flat))):  # (any layout)
        ch = chunk_of(shape, unit.world_size, unit.rank)
        chunks.append(whole.reshape(-1)[ch.start : ch.stop].clone().view(ch.shape))
    return chunks


def chunks_to_flat(unit, chunks: list[torch.Tensor | None]) -> torch.Tensor:
    """This rank's FSDP2 chunk of every parameter (None: zeros) -> (S,) this rank's shard."""
    layout, n = unit.layout, unit.world_size
    mine = [chunk_of(s, n, unit.rank) for s in layout.shapes]
    seg = [0]  # where each parameter's padded chunk sits in a rank's contribution
    for ch, t in zip(mine, chunks):
        seg.append(seg[-1] + (ch.padded if t is not None else 0))
    dtype = next((t.dtype for t in chunks if t is not None), unit.sharded.dtype)
    send = unit.sharded.new_zeros(seg[-1], dtype=dtype)
    for i, (ch, t) in enumerate(zip(mine, chunks)):
        if t is not None and ch.padded:  # not a 0-d parameter: every rank has that whole
            send[seg[i] : seg[i] + t.numel()] = t.reshape(-1)
    got = send.new_empty(n * seg[-1])
    if seg[-1]:
        # (L,) per rank -> (N*L,): every rank's chunks of this unit, transient
        comm.all_gather(got, send, group=unit.group, unit=unit.name, phase="other",
                        ctx=unit.root.context)
    del send  # (before the shard is allocated: load holds one unit, not one and a bit)

    shard = unit.sharded.new_zeros(layout.shard_numel, dtype=dtype)
    for piece in layout.pieces(unit.rank):
        i, want = piece.param_index, piece.param_offset
        if chunks[i] is None:
            continue
        if len(layout.shapes[i]) == 0:  # 0-d: every rank loaded the whole value
            shard[piece.shard_offset] = chunks[i].reshape(())
            continue
        for q in range(n):  # the ranks whose chunk overlaps this piece
            ch = chunk_of(layout.shapes[i], n, q)
            lo, hi = max(ch.start, want), min(ch.stop, want + piece.length)
            if lo < hi:
                src = q * seg[-1] + seg[i] + lo - ch.start
                dst = piece.shard_offset + lo - want
                shard[dst : dst + hi - lo] = got[src : src + hi - lo]
    return shard
