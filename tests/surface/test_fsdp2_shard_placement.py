"""``shard_placement_fn`` returning ``Shard(dim)``: bitwise FSDP2's, in the rows layout.

torchtitan shards MoE experts, a 3-D parameter with fewer experts (rows) than ranks, along
dim 1 this way. FSDP2 requires the dim to divide evenly and copies the chunks along it in and
out of its buffers; zero lays them out stacked on dim 0 and moves them by the same copies
(``zero/core/placement.py``). Losses, gradients and parameters after each step, and the
parameters' placements, are compared with ``torch.equal``. The suite runs 2 ranks; 4 ranks
(2 experts: fewer than the ranks) and mixed precision are in the full matrix (``ZERO_FULL=1``).
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import zero
from conftest import sample
from harness import run_ranks


class Experts(nn.Module):
    """Every expert's up and down projection in one 3-D parameter each (torchtitan's
    ``GroupedExperts``), applied to the tokens routed to it (here: token t to expert t % E)."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)

    def forward(self, x):
        e = self.w1.shape[0]
        out = torch.empty_like(x)
        for k in range(e):
            out[k::e] = torch.relu(x[k::e] @ self.w1[k]) @ self.w2[k]
        return out


class MoE(nn.Module):
    def __init__(self, experts: int = 2, dim: int = 8, hidden: int = 12):
        super().__init__()
        self.router = nn.Linear(dim, dim)
        self.experts = Experts(experts, dim, hidden)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.norm(x + self.experts(self.router(x))))


def experts_on_dim_1(p: nn.Parameter):
    """torchtitan's rule, made to bite at any world size: 3-D expert weights on dim 1."""
    return Shard(1) if p.ndim == 3 else None


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(rank, n, mp, fn):
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    base = MoE()
    policy = MixedPrecisionPolicy(*mp) if mp else MixedPrecisionPolicy()
    runs = []
    for fs in (fully_shard, zero.fully_shard):
        model = copy.deepcopy(base)
        fs(model.experts, mesh=mesh, mp_policy=policy, shard_placement_fn=fn)
        fs(model, mesh=mesh, mp_policy=policy, shard_placement_fn=fn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for s in range(3):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * s + rank))
            loss = model(x.to(mp[0]) if mp else x).float().pow(2).mean()
            loss.backward()
            grads = {k: full(p.grad).clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            steps.append((loss.detach(), grads,
                          {k: full(p).detach().clone() for k, p in model.named_parameters()}))
        placed = {k: (p.placements, tuple(p.to_local().shape))
                  for k, p in model.named_parameters()}
        runs.append((steps, placed))
    (ref, ref_placed), (ours, our_placed) = runs
    out = [f"{k}: placed {our_placed[k]}, FSDP2 {ref_placed[k]}" for k in ref_placed
           if our_placed[k] != ref_placed[k]]
    for s, (a, b) in enumerate(zip(ref, ours)):
        if not torch.equal(a[0], b[0]):
            out.append(f"step {s}: loss {a[0].item()} != {b[0].item()}")
        out += [f"step {s}: {what} {k}" for what, i in (("grad", 1), ("param", 2))
                for k in a[i] if not torch.equal(a[i][k], b[i][k])]
    return out


CASES = [(2, None)]
EVERY = [(n, mp) for n in (2, 4) for mp in (None, (torch.bfloat16, torch.float32))]


@pytest.mark.parametrize("n,mp", sample(CASES, EVERY))
def test_shard_placement_fn_shard_1_is_bitwise_fsdp2s(n, mp):
    assert run_ranks(_train, n, mp, experts_on_dim_1) == [[]] * n


def _refused(rank, n):
    mesh = init_device_mesh("cpu", (n,))
    out = {}
    cases = {
        "odd": (dict(), lambda p: Shard(0) if p.ndim < 2 else Shard(p.ndim - 1)),
        "out of range": (dict(), lambda p: Shard(3)),
        "flat": (dict(layout="flat"), experts_on_dim_1),
    }
    for name, (kw, fn) in cases.items():
        torch.manual_seed(0)
        model = MoE(dim=9)  # router (9, 9): dim 1 of 9 does not divide over 2 ranks
        try:
            zero.fully_shard(model, mesh=mesh, shard_placement_fn=fn, **kw)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_a_placement_that_cannot_be_served_is_refused_naming_why():
    out = run_ranks(_refused, 2)[0]
    assert "does not divide over 2 ranks" in out["odd"] and "router.weight" in out["odd"]
    assert "Shard(3)" in out["out of range"]
    assert "layout='rows'" in out["flat"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_rows_layout_moves_shard_d_chunks_as_fsdp2s_buffers_hold_them(n):
    """Single process: a unit of parameters placed on dims 0, 1 and 2. The layout's
    rank-major buffer (to_wire) is FSDP2's reduce-scatter input, rank r's row the
    concatenation of every parameter's chunk r (dim 0: padded to ceil(d0 / n) rows; dim d:
    torch.chunk along d), and from_wire puts it back."""
    from zero.core.placement import Placement
    from zero.core.rows import RowsLayout

    shapes, dims = [(5, 3), (2, 4 * n), (3, 2, 2 * n), (7,)], [0, 1, 2, 0]
    placements = [Placement(s, n, d) for s, d in zip(shapes, dims)]
    layout = RowsLayout.placing(placements)([p.rows_shape for p in placements], n)
    torch.manual_seed(0)
    params = [torch.randn(s) for s in shapes]
    compute = layout.flatten(params)
    want = []
    for r in range(n):
        for p, d in zip(params, dims):
            rows = -(-p.shape[0] // n)
            chunk = torch.chunk(p, n, dim=d)[r] if d else p[r * rows:(r + 1) * rows]
            pad = (rows * p[0].numel() - chunk.numel()) if d == 0 else 0
            want += [chunk.reshape(-1), torch.zeros(pad)]
    wire = layout.to_wire(compute)
    assert torch.equal(wire, torch.cat(want))
    back = layout.from_wire(wire)
    assert all(torch.equal(a, b) for a, b in zip(layout.views(back), params))
    for r in range(n):  # each rank's piece, as the parameter FSDP2 shows it: its chunk
        i = 1
        lo, hi = layout.rows_of(i, r)
        piece = wire[layout.shard(r).offset:][layout.seg[i]:][:layout.chunk[i]]
        assert torch.equal(piece.view(placements[i].sharded_shape(hi - lo)),
                           torch.chunk(params[i], n, dim=1)[r])


def _ranks_disagree(rank, n):
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    fn = experts_on_dim_1 if rank == 0 else None  # rank 1 forgot it: same sizes, other rows
    try:
        zero.fully_shard(MoE(), mesh=mesh, shard_placement_fn=fn)
        return "accepted"
    except ValueError as e:
        return str(e)


def test_ranks_that_place_a_parameter_differently_raise_naming_it():
    for said in run_ranks(_ranks_disagree, 2):
        assert "shard_placement_fn differs" in said, said
