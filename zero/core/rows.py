"""FSDP2's layout: every parameter cut along dim 0, each rank holding its rows of each one.

As ``torch.chunk``, ``c = ceil(d0 / N)`` rows a rank, padded to c. Gathered rank-major, the
parameters need it parameter-major::

    gathered (N, S):      | r0: p0 rows 0-1 | p1 rows 0-2 || r1: p0 rows 2-3 | p1 rows 3-5 |
    compute (N*S,):       | p0: rows 0-3 (+ padding)     || p1: rows 0-5 (+ padding)     |

so ``from_wire`` / ``to_wire`` copy, as FSDP2 (notes/16-layouts.md, "rows: FSDP2's"). The
interface is ``zero/core/flat.py``'s (its note).
"""

from __future__ import annotations

import math
from typing import Sequence, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zero.api import Comm, Layout, Piece, SendingForm, ShardInfo, Work
from zero.comm.context import finish
from zero.core.flat import LocalShard
from zero.core.placement import Placement


def local_tensor(t):
    """The local tensor of a DTensor (this rank's rows), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class RowsLayout:
    """FSDP2's dim-0 chunks (module docstring) of ``shapes`` as laid out (tp: the local shape;
    ``Shard(d)``: its stack) over ``world_size`` ranks."""

    name = "rows"
    copies = True  # gathered rank-major, computed parameter-major
    empty_pieces_get_grads = True  # FSDP2 gives an empty local gradient to a rank with no rows
    exposes_dtensors = True  # parameters shown as DTensors of their full shape (FSDP2's)
    whole_parameters = False  # each parameter whole on one rank, in its own shape
    placements: tuple = ()  # each parameter's Placement, when made by ``placing``

    @classmethod
    def placing(cls, placements: Sequence[Placement]) -> type:
        """This layout, as a class that knows each parameter's placement (``Shard(d)``, tp)."""
        return type(cls.__name__, (cls,), {"placements": tuple(placements)})

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int):
        self.shapes = [torch.Size(s) for s in shapes]
        if any(len(s) == 0 for s in self.shapes):
            raise ValueError("layout='rows' cuts each parameter along dim 0, and a 0-d parameter "
                             "has none (FSDP2 rejects it too): make it 1-d (shape (1,)), or "
                             "use layout='flat'")
        n = self.world_size = world_size
        self.numels = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.numels)
        self.row = [math.prod(s[1:]) for s in self.shapes]  # elements per row
        self.chunk_rows = [-(-s[0] // n) for s in self.shapes]  # c: rows of a full chunk
        self.chunk = [c * r for c, r in zip(self.chunk_rows, self.row)]  # its elements, padded
        self.seg = [sum(self.chunk[:i]) for i in range(len(self.chunk))]  # where, in a shard
        self.shard_numel = sum(self.chunk)
        self.padded_numel = n * self.shard_numel
        # the compute buffer: parameter i in its own region of N chunks, rows 0.. then padding
        self.offsets = [n * s for s in self.seg]
        self.placements = self.placements or tuple(Placement(s, n) for s in self.shapes)
        self.view_shapes = [p.local_shape for p in self.placements]  # (Shard(d): unstacked)
        self._moved = [i for i, p in enumerate(self.placements) if p.dim != 0]

    def shard(self, rank: int) -> ShardInfo:
        return ShardInfo(offset=rank * self.shard_numel, size=self.shard_numel)

    def rows_of(self, i: int, rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of parameter i that ``rank`` holds (``torch.chunk``'s)."""
        c, d0 = self.chunk_rows[i], self.shapes[i][0]
        return min(rank * c, d0), min((rank + 1) * c, d0)

    def pieces(self, rank: int) -> list[Piece]:
        out = []
        for i in range(len(self.shapes)):
            lo, hi = self.rows_of(i, rank)
            if hi > lo and self.row[i]:
                out.append(Piece(i, param_offset=lo * self.row[i], shard_offset=self.seg[i],
                                 length=(hi - lo) * self.row[i]))
        return out

    def local(self, rank: int) -> LocalShard:
        return LocalShard(self, rank)

    def views(self, compute: torch.Tensor) -> list[torch.Tensor]:
        """The parameters in the compute buffer: one ``split``, each parameter's rows first."""
        sizes = [x for numel, c in zip(self.numels, self.chunk)
                 for x in (numel, self.world_size * c - numel)]
        parts = compute.split(sizes)
        return [parts[2 * i].view(s) for i, s in enumerate(self.view_shapes)]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A compute buffer holding ``tensors`` (zero padding)."""
        compute = tensors[0].new_zeros(self.padded_numel)
        for v, t in zip(self.views(compute), tensors):
            v.copy_(t)
        return compute

    def _regions(self, compute: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's region of the compute buffer as (N, c*row): row r is rank r's chunk."""
        return [compute[o : o + self.world_size * c].view(self.world_size, c)
                for o, c in zip(self.offsets, self.chunk)]

    def from_wire(self, wire: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """(N*S,) rank-major -> the parameter-major compute buffer (``into``, if given)."""
        compute = wire.new_empty(self.padded_numel) if into is None else into
        if self.padded_numel:
            regions = self._regions(compute)
            # Shard(d), d > 0: through a temporary, then its chunks back along d (FSDP2's too)
            moved = {i: torch.empty_like(regions[i]) for i in self._moved}
            torch.split_with_sizes_copy(wire.view(self.world_size, self.shard_numel), self.chunk,
                                        dim=1, out=[moved.get(i, r) for i, r in enumerate(regions)])
            for i, rows in moved.items():
                self.placements[i].unstack(rows, regions[i])
        return compute

    def to_wire(self, compute: torch.Tensor) -> torch.Tensor:
        """The parameter-major compute buffer (a gradient) -> (N*S,) rank-major, a new buffer."""
        if not self.padded_numel:
            return compute.new_empty(0)
        regions = self._regions(compute)
        for i in self._moved:  # Shard(d), d > 0: its chunks along d, stacked (a copy)
            regions[i] = self.placements[i].stack(regions[i])
        return torch.cat(regions, dim=1).view(-1)

    def exposed(self, piece: torch.Tensor, i: int, rank: int, group) -> torch.Tensor:
        """Rank ``rank``'s rows of parameter i as FSDP2 shows them: a DTensor viewing ``piece``."""
        if not isinstance(group, DeviceMesh):
            raise TypeError("layout='rows' places its DTensors on a DeviceMesh (zero.shard "
                            f"makes one per unit), got {type(group).__name__}")
        lo, hi = self.rows_of(i, rank)
        placement = self.placements[i]
        return placement.sharded(piece.view(placement.sharded_shape(hi - lo)), group)


class CopiedOut:
    """An all-gather into the wire buffer; ``wait()`` copies it out where the parameters view."""

    def __init__(self, work: Work, layout: Layout, wire: torch.Tensor, compute: torch.Tensor):
        self.work, self.layout, self.wire, self.compute = work, layout, wire, compute

    def wait(self):
        finish(self.work)
        self.layout.from_wire(self.wire, into=self.compute)
        del self.wire  # (the gathered buffer goes, once copied out)


def gather_sending(layout: RowsLayout, full: torch.Tensor, shard: torch.Tensor,
                   forms: dict[int, SendingForm], mesh: DeviceMesh, *, group, unit: str,
                   phase: str, ctx: Comm) -> Work:
    """One all-gather of the plain rows and each ``SendingForm``'s inputs (FSDP2's all-gather
    extension; bytes if dtypes differ); ``wait()`` fills ``full`` and the forms' outputs."""
    n = layout.world_size
    if mesh.ndim == 2:  # (HSDP's (replicate, shard): the shard dim, by the mesh's own names)
        mesh = mesh[cast(tuple, mesh.mesh_dim_names)[-1]]
    wire = full.view(n, layout.shard_numel)
    sends: list[torch.Tensor] = []  # this rank's pieces, in order
    goes: list = []  # where every rank's piece goes: wire columns, or (form, k, input k)
    for i, (seg, chunk) in enumerate(zip(layout.seg, layout.chunk)):
        if i in forms:
            inputs = forms[i].inputs(mesh, layout.chunk_rows[i])
            sends += inputs
            goes += [(forms[i], k, t) for k, t in enumerate(inputs)]
        elif chunk:
            sends.append(shard[seg:seg + chunk].to(full.dtype))  # (the cast, as ever)
            goes.append(wire[:, seg:seg + chunk])
    mixed = len({t.dtype for t in sends}) > 1
    as_sent = [t.view(torch.uint8) if mixed else t for t in sends]
    send = torch.cat(as_sent) if as_sent else full.new_empty(0)
    got = send.new_empty(n * send.numel())
    # (B,) per rank -> (N*B,): the plain rows and the forms' inputs, in one
    work = ctx.all_gather(got, send, group=group, unit=unit, phase=phase, async_op=True)
    return _Arrived(work, send, got, goes, [t.numel() for t in as_sent], mixed, forms,
                    full.dtype, n)


class _Arrived:
    """``gather_sending``'s all-gather in flight; ``wait()`` copies each piece where it goes."""

    def __init__(self, work, send, got, goes, sizes, mixed, forms, param_dtype, n):
        self.work, self.send, self.got, self.goes = work, send, got, goes  # (alive till then)
        self.sizes, self.mixed, self.forms = sizes, mixed, forms
        self.param_dtype, self.n = param_dtype, n

    def wait(self):
        finish(self.work)
        if self.sizes:
            outs = [go if torch.is_tensor(go) else go[0].output(go[1], go[2], self.n)
                    for go in self.goes]
            outs = [t.view(torch.uint8) if self.mixed else t for t in outs]
            # (outputs autograd may hold for backward are refilled, not changed: FSDP2's way)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
                torch.split_with_sizes_copy(self.got.view(self.n, -1), self.sizes, dim=1, out=outs)
        for form in self.forms.values():
            form.arrived(self.param_dtype)
        self.send = self.got = self.goes = None
