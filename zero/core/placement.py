"""Where a parameter sits besides zero's rows: FSDP2's shard dim, and a tensor-parallel mesh.

One ``Placement`` per parameter, as FSDP2's ``FSDPParam._init_sharded_param`` composes
(notes/16-layouts.md, "rows, composed"):

- ``Shard(d)``: the parameter "in rows" is its chunks along d stacked on dim 0 (``in_rows``),
  so only the copies move chunks (``stack`` / ``unstack``).

      a parameter (2, 4), Shard(1), N = 2:      in rows, (4, 2):
          | a0 a1 | b0 b1 |                         | a0 a1 |  rank 0's rows: its chunk
          | a2 a3 | b2 b3 |                         | a2 a3 |
                                                    | b0 b1 |  rank 1's rows
                                                    | b2 b3 |

- A tensor-parallel ``DTensor``: its *local* tensor is sharded by rows; the optimizer sees a
  DTensor on ``(dp, tp)`` (``sharded``), the module one on the tp mesh (``unsharded``).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from zero.api import Layout
from zero.core.same_model import values


class Placement:
    """One parameter's place besides its rows (module note): ``local_shape`` is the tensor the
    N = ``world_size`` data-parallel ranks share, ``dim`` FSDP2's shard dim (``Shard(dim)``),
    ``spec`` the parameter's own DTensor spec (tp mesh, placements, shape), or None."""

    sends = False  # (its local rows go as any parameter's)

    def __init__(self, local_shape, world_size: int, dim: int = 0, spec=None):
        self.local_shape, self.world_size = torch.Size(local_shape), world_size
        self.dim, self.spec = dim, spec
        n, d = world_size, dim
        # dim d's chunks stacked along dim 0: (N*s0, ..., s_d/N, ...); dim 0: the shape itself
        self.rows_shape = self.local_shape if d == 0 else torch.Size(
            [n * self.local_shape[0], *self.local_shape[1:d], self.local_shape[d] // n,
             *self.local_shape[d + 1:]])
        self._spmd: dict = {}  # data-parallel mesh -> (dp+tp mesh, placements): made once

    @classmethod
    def of(cls, param: torch.Tensor, world_size: int, dim: int = 0) -> "Placement":
        """``param``'s placement when sharded by rows over ``world_size`` ranks along ``dim``."""
        if isinstance(param, DTensor):
            return cls(param._local_tensor.shape, world_size, dim, param._spec)
        return cls(param.shape, world_size, dim)

    @property
    def plain(self) -> bool:
        """Rows along dim 0 of a tensor of no mesh of its own: nothing to add to the layout."""
        return self.dim == 0 and self.spec is None

    @property
    def shape(self) -> torch.Size:
        """The parameter's full (global) shape."""
        return self.local_shape if self.spec is None else self.spec.shape

    # ---- the parameter in rows, and back ---------------------------------------------------

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as (before d, N, the rest): block [:, r] is rank r's chunk along d."""
        pre = math.prod(self.local_shape[: self.dim])
        return t.reshape(-1).view(pre, self.world_size, -1)

    def in_rows(self, local: torch.Tensor) -> torch.Tensor:
        """The local tensor in rows: itself for dim 0, else its chunks along d stacked (a copy)."""
        if self.dim == 0:
            return local
        return torch.cat(torch.chunk(local, self.world_size, dim=self.dim)).view(self.rows_shape)

    def stack(self, region: torch.Tensor) -> torch.Tensor:
        """(N, c) rank-major rows (a copy) of the parameter's region, before a reduce-scatter."""
        return self._blocks(region).transpose(0, 1).reshape(self.world_size, -1)

    def unstack(self, rows: torch.Tensor, region: torch.Tensor) -> None:
        """The inverse: (N, c) rank-major rows into the parameter's region, after an all-gather."""
        pre = math.prod(self.local_shape[: self.dim])
        self._blocks(region).copy_(rows.reshape(self.world_size, pre, -1).transpose(0, 1))

    # ---- how it is shown ------------------------------------------------------------------

    def sharded_shape(self, rows: int) -> torch.Size:
        """The shape of a rank's chunk of ``rows`` rows in rows."""
        if self.dim == 0:
            return torch.Size([rows, *self.local_shape[1:]])
        return torch.Size([*self.local_shape[: self.dim], self.local_shape[self.dim] //
                           self.world_size, *self.local_shape[self.dim + 1:]])

    def placements(self, mesh: DeviceMesh) -> tuple[DeviceMesh, tuple]:
        """FSDP2's mesh and placements of the sharded parameter over the dp ``mesh``."""
        if mesh in self._spmd:
            return self._spmd[mesh]
        dp_mesh = mesh
        dp: Shard | _StridedShard = Shard(self.dim)
        if self.spec is not None:
            # tp cuts dim d into k too: a dp rank's rows are every k-th block (FSDP2's)
            k = self.spec.num_shards_map[self.dim]
            dp = _StridedShard(self.dim, split_factor=k) if k > 1 else dp
        placements = (Replicate(), dp) if dp_mesh.ndim == 2 else (dp,)
        if self.spec is not None:
            placements += tuple(self.spec.placements)
            mesh = DeviceMesh._concatenate([dp_mesh, self.spec.mesh])  # (dp, tp): no new group
        self._spmd[dp_mesh] = (mesh, placements)
        return mesh, placements

    def sharded(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """This rank's chunk as FSDP2 shows the sharded parameter: a DTensor of the full shape."""
        spmd, placements = self.placements(mesh)
        shape = self.shape
        stride = self.spec.stride if self.spec is not None else \
            torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, spmd, placements, run_check=False, shape=shape,
                                  stride=stride)

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        """What the module computes with: the view, or a DTensor on the tp mesh over it."""
        if self.spec is None:
            return view
        return DTensor.from_local(view, self.spec.mesh, self.spec.placements, run_check=False,
                                  shape=self.spec.shape, stride=self.spec.stride)

    def free(self) -> None:
        """Nothing of its own to free when the unit reshards."""

    def __repr__(self) -> str:
        tp = "" if self.spec is None else f", tp {self.spec.placements}"
        return f"Placement(Shard({self.dim}){tp}, local {tuple(self.local_shape)})"


def chosen_dim(shard_placement_fn, name: str, p: torch.Tensor) -> int:
    """The dim ``shard_placement_fn`` chooses for ``p`` (None: 0); raises as FSDP2 would."""
    chosen = shard_placement_fn(p) if shard_placement_fn is not None else None
    if chosen is None:
        return 0
    if not isinstance(chosen, Shard):
        raise ValueError(f"shard_placement_fn returned {chosen!r} for {name}: FSDP2 takes "
                         "Shard(dim) or None (Shard(0))")
    if not -max(p.ndim, 1) <= chosen.dim < max(p.ndim, 1):
        raise ValueError(f"shard_placement_fn returned Shard({chosen.dim}) for {name}, which "
                         f"has {p.ndim} dims")
    return chosen.dim % max(p.ndim, 1)


def placements_of(params, world_size: int, shard_placement_fn=None) -> list[Placement]:
    """Each parameter's ``Placement`` over ``world_size`` data-parallel ranks."""
    return [Placement.of(p, world_size, chosen_dim(shard_placement_fn, "", p)) for p in params]


def check(layout: type[Layout], names, world_size: int, mesh, shard_placement_fn=None) -> None:
    """Raise, naming the parameter and the fix, if a parameter cannot be placed."""
    for name, p in names:
        dim = chosen_dim(shard_placement_fn, name, p)
        spec = p._spec if isinstance(p, DTensor) else None
        if spec is None and dim == 0:
            continue  # plain: dim-0 rows, every layout's
        what = (f"{name} is a DTensor on a tensor-parallel mesh ({spec.placements})"
                if spec is not None else f"shard_placement_fn places {name} on Shard({dim})")
        if not hasattr(layout, "placing"):
            raise ValueError(f"{what}, which layout={layout.name!r} cannot place: use "
                             "layout='rows' (FSDP2's, zero.fully_shard's default)")
        local = p._local_tensor.shape if spec is not None else p.shape
        if dim and local[dim] % world_size:
            raise ValueError(f"{what}: its dim {dim} ({local[dim]}) does not divide over "
                             f"{world_size} ranks, and Shard(d > 0) must (FSDP2 refuses it "
                             "too): return Shard(0) for it, or choose a dim that divides")
        if spec is not None:
            _check_tensor_parallel(what, spec, mesh)


def _check_tensor_parallel(what: str, spec, mesh) -> None:
    """A 1-D tp mesh, and a dp mesh that combines with it (as FSDP2 requires)."""
    if len(spec.placements) != 1 or not isinstance(spec.placements[0], (Shard, Replicate)):
        raise ValueError(f"{what}: zero composes with tensor parallel on a 1-D mesh, placed "
                         "Shard(d) or Replicate(); give it such a DTensor")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"{what}: give the data-parallel mesh as mesh= (mesh['dp'], cut from "
                         "the same mesh as the tensor-parallel one), not a group")
    try:
        DeviceMesh._concatenate([mesh, spec.mesh])
    except Exception as e:  # noqa: BLE001 - said with the fix
        raise ValueError(f"{what}, but its mesh and the data-parallel mesh given ({mesh}) do "
                         "not combine into one (dp, tp) mesh: cut both from one "
                         f"init_device_mesh(..., mesh_dim_names=('dp', 'tp')) ({e})") from None


def lay_out(layout: type[Layout], params, world_size: int, shard_placement_fn=None):
    """The layout class, the tensors it lays out (local values in rows) and the placements."""
    placements = placements_of(params, world_size, shard_placement_fn)
    if all(p.plain for p in placements) and all(values(p) is p for p in params):
        return layout, list(params), placements
    laid = []
    for p, placement in zip(params, placements):
        t = placement.in_rows(values(p).detach())
        laid.append(t.requires_grad_(p.requires_grad) if t.is_floating_point() else t)
    # (check() raised unless the layout can place parameters: it has ``placing``)
    return layout.placing(placements), laid, placements  # type: ignore[attr-defined]


def forms(placements) -> list:
    """Per parameter: its form's maker if tensor parallel (its ``Placement``), else None."""
    return [None if p.spec is None else (lambda sp, p=p: p) for p in placements]


def refuse(units, what: str, fix: str, *, any_dim: bool = False) -> None:
    """Raise, naming ``fix``, if a parameter of ``units`` is tensor parallel (or, with
    ``any_dim``, not on dim 0): ``what`` reads shards as dim-0 rows. Every rank raises."""
    for unit in units:
        for i, p in enumerate(getattr(unit.layout, "placements", ())):
            if p.spec is not None or (any_dim and p.dim != 0):
                name = next((f"{type(m).__name__}.{a}" for m, a in unit.locations[i]), "?")
                kind = ("a tensor-parallel parameter" if p.spec is not None
                        else f"a parameter placed on Shard({p.dim})")
                raise NotImplementedError(f"{what} does not serve {kind} ({name} of unit "
                                          f"{unit.name}): {fix}")
