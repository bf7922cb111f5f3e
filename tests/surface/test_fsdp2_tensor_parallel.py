"""Tensor parallel + FSDP (2-D), as FSDP2 composes them: bitwise FSDP2's, on 4 gloo ranks.

Each block is parallelized over the "tp" dim of a (dp, tp) = (2, 2) mesh with torch's own
plans (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``), then sharded over
"dp" by ``fully_shard`` in one copy and ``zero.fully_shard`` in the other (the rows layout:
each parameter's tensor-parallel local tensor cut along dim 0, the sharded parameter a
DTensor on the (dp, tp) mesh; ``zero/core/placement.py``). Losses, gradients and parameters
are compared with ``torch.equal`` after every step, and so are the sharded parameters'
placements (what DCP writes), torch's ``clip_grad_norm_`` on the 2-D gradients, and DCP
checkpoints moved from one to the other. The suite runs one plan; ``ZERO_FULL=1`` runs every
plan with mixed precision, stages 1 and 2, rows that do not divide, and HSDP + TP on 8 ranks.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import zero
from conftest import sample
from harness import run_ranks

DIM, HIDDEN, SEQ = 8, 16, 4


class Block(nn.Module):
    """A pre-norm MLP block: the norm, then up (column-wise), then down (row-wise)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """Plain parameters at the root (an input projection and a head), TP blocks between."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(2))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


# Each plan is torch's own, applied to every block over the "tp" mesh.
PLANS = {
    # Megatron's MLP: the input replicated, the output all-reduced (Rowwise's Partial)
    "colwise-rowwise": lambda: {"up": ColwiseParallel(), "down": RowwiseParallel()},
    # sequence parallel: the norm on sequence shards (its weight Replicate, its gradient
    # Partial over tp), the block's input and output sharded on the sequence dim
    "sequence-parallel": lambda: {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))},
}


def _sequence_parallel_block(block, tp_mesh):
    """The sequence-parallel plan's block takes and returns sequence shards: around it, the
    residual stream is gathered back (a plain tensor, as the root's layers expect)."""
    inner = block.forward

    def forward(x):
        rank, n = tp_mesh.get_local_rank(), tp_mesh.size()
        local = x.chunk(n, dim=1)[rank]  # this rank's sequence positions
        out = DTensor.from_local(inner(local), tp_mesh, [Shard(1)], run_check=False)
        return out.full_tensor()
    block.forward = forward


def build(base, plan, fs, mesh, mp=None, **kw):
    model = copy.deepcopy(base)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLANS[plan]())
        if plan == "sequence-parallel":
            _sequence_parallel_block(block, mesh["tp"])
    policy = MixedPrecisionPolicy(*mp) if mp else MixedPrecisionPolicy()
    dp = mesh["dp"] if "dp" in mesh.mesh_dim_names else mesh["dp_replicate", "dp_shard"]
    for block in model.blocks:
        fs(block, mesh=dp, mp_policy=policy, **kw)
    fs(model, mesh=dp, mp_policy=policy, **kw)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch(mesh, step: int, mp) -> torch.Tensor:
    """Each dp rank its own batch; the tp ranks of one dp rank the same (tp splits the work
    on one batch, not the batch)."""
    dp_rank = mesh.get_coordinate()[0] if mesh.ndim == 2 else (
        mesh.get_coordinate()[0] * mesh.shape[1] + mesh.get_coordinate()[1])
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    x = torch.randn(2, SEQ, DIM, generator=g)
    return x.to(mp[0]) if mp else x


def _train(rank, n, plan, mp, stage, hidden, hsdp):
    shape = (2, 2, 2) if hsdp else (2, 2)
    names = ("dp_replicate", "dp_shard", "tp") if hsdp else ("dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    base = Net(hidden=hidden)
    runs, out = [], []
    for fs in (fully_shard, lambda m, **kw: zero.fully_shard(m, stage=stage, **kw)):
        model = build(base, plan, fs, mesh, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for s in range(3):
            x = batch(mesh, s, mp)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            grads = {k: full(p.grad).clone() for k, p in model.named_parameters()}
            # torch's clipping on the 2-D (dp, tp) gradients (DTensor cannot stack the norms
            # of two meshes: the root's plain parameters are clipped on their own)
            blocks = [p for p in model.parameters() if p.device_mesh.ndim == mesh.ndim]
            norm = full(torch.nn.utils.clip_grad_norm_(blocks, 0.05))
            clipped = {k: full(p.grad).clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            steps.append((loss.detach(), grads, norm, clipped,
                          {k: full(p).detach().clone() for k, p in model.named_parameters()}))
        placed = {k: (v.device_mesh, v.placements, tuple(v.to_local().shape))
                  for k, v in model.state_dict().items()}  # (what DCP writes)
        runs.append((steps, placed))
    (ref, ref_placed), (ours, our_placed) = runs
    for s, (a, b) in enumerate(zip(ref, ours)):
        if not torch.equal(a[0], b[0]):
            out.append(f"step {s}: loss {a[0].item()} != {b[0].item()}")
        for what, i in (("grad", 1), ("clipped grad", 3), ("param", 4)):
            out += [f"step {s}: {what} {k}" for k in a[i] if not torch.equal(a[i][k], b[i][k])]
        if not torch.equal(a[2], b[2]):
            out.append(f"step {s}: clip_grad_norm_ {a[2].item()} != {b[2].item()}")
    out += [f"{k}: placed {our_placed[k]}, FSDP2 {ref_placed[k]}" for k in ref_placed
            if our_placed[k] != ref_placed[k]]
    return out


FSDP2_CASES = [("sequence-parallel", None, 3, HIDDEN)]
EVERY = [(plan, mp, stage, hidden) for plan in PLANS
         for mp in (None, (torch.bfloat16, torch.float32))
         for stage in (1, 2, 3) for hidden in (HIDDEN, 10)]  # 10: tp-local rows 5, uneven


@pytest.mark.parametrize("plan,mp,stage,hidden", sample(FSDP2_CASES, EVERY))
def test_tensor_parallel_then_fully_shard_is_bitwise_fsdp2s(plan, mp, stage, hidden):
    assert run_ranks(_train, 4, plan, mp, stage, hidden, False, timeout=120) == [[]] * 4


@pytest.mark.full
def test_hsdp_with_tensor_parallel_is_bitwise_fsdp2s():
    # (replicate, shard, tp) = (2, 2, 2): 8 ranks
    assert run_ranks(_train, 8, "sequence-parallel", None, 3, HIDDEN, True,
                     timeout=300) == [[]] * 8


# ---- checkpoints: DCP both ways, torch's full state dict ---------------------------------


def _dcp_both_ways(rank, n, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def system(seed, fs):
        torch.manual_seed(seed)
        model = build(Net(), "colwise-rowwise", fs, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, s):
        loss = model(batch(mesh, s, None)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def save(model, opt, path):
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)

    def load(model, opt, path):
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])

    def params(model):
        return {k: full(p).detach().clone() for k, p in model.named_parameters()}

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    out = []
    ours = system(0, zero.fully_shard)
    step(*ours, 0)
    save(*ours, f"{tmp}/ours")
    theirs = system(1, fully_shard)  # other values, other optimizer state: overwritten
    step(*theirs, 5)
    load(*theirs, f"{tmp}/ours")
    if not same(params(ours[0]), params(theirs[0])):
        out.append("ours -> FSDP2: parameters differ after the load")
    if not torch.equal(step(*ours, 1), step(*theirs, 1)) or not same(params(ours[0]),
                                                                       params(theirs[0])):
        out.append("ours -> FSDP2: the next step differs (the optimizer state?)")
    save(*theirs, f"{tmp}/theirs")
    again = system(2, zero.fully_shard)
    step(*again, 7)
    load(*again, f"{tmp}/theirs")
    if not same(params(theirs[0]), params(again[0])):
        out.append("FSDP2 -> ours: parameters differ after the load")
    if not torch.equal(step(*theirs, 2), step(*again, 2)) or not same(params(theirs[0]),
                                                                        params(again[0])):
        out.append("FSDP2 -> ours: the next step differs (the optimizer state?)")
    # what zero.full_state_dict refuses for tensor parallel, torch's full state dict does
    whole = StateDictOptions(full_state_dict=True)
    a, b = get_model_state_dict(again[0], options=whole), get_model_state_dict(theirs[0],
                                                                              options=whole)
    if list(a) != list(b) or not same(a, b):
        out.append("torch's full state dict differs")
    return out


def test_dcp_checkpoints_move_between_fsdp2_and_zero_both_ways(tmp_path):
    assert run_ranks(_dcp_both_ways, 4, str(tmp_path), timeout=120) == [[]] * 4


# ---- what cannot be served is refused, naming what can ---------------------------------


def _refusals(rank, n):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}

    def tp_block():
        torch.manual_seed(0)
        block = Block(DIM, HIDDEN)
        parallelize_module(block, mesh["tp"], PLANS["colwise-rowwise"]())
        return block

    for name, kw in {"flat": dict(layout="flat"), "whole": dict(layout="whole"),
                     "group": dict(group=mesh["dp"].get_group())}.items():
        try:
            if name == "group":
                zero.shard(tp_block(), layout="rows", **kw)
            else:
                zero.fully_shard(tp_block(), mesh=mesh["dp"], **kw)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    model = zero.fully_shard(tp_block(), mesh=mesh["dp"])
    model(torch.randn(2, DIM)).sum().backward()
    calls = {"clip": lambda: zero.clip_grad_norm_(model, 1.0),
             "full_state_dict": lambda: zero.full_state_dict(model),
             "save": lambda: zero.save("/nonexistent", model)}
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except NotImplementedError as e:
            out[name] = str(e)
    return out


def test_what_cannot_serve_tensor_parallel_refuses_naming_what_can():
    out = run_ranks(_refusals, 4)[0]
    for layout in ("flat", "whole"):
        assert f"layout={layout!r} cannot place" in out[layout] and "layout='rows'" in out[layout]
    assert "mesh=" in out["group"]
    assert "torch.nn.utils.clip_grad_norm_" in out["clip"]
    assert "full_state_dict=True" in out["full_state_dict"]
    assert "get_model_state_dict" in out["save"]
