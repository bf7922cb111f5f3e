"""zero.fully_shard: code written for FSDP2 finds what it looks for, or a named refusal.

Real training code asks ``isinstance(module, FSDPModule)`` and calls FSDP2's methods; where it
does not find them it skips them, silently (torchtitan's gradient divide factor, its chunked
loss's unsynced head). Each case here is such a call, made as FSDP2's users make it, against
FSDP2 itself.
"""

import contextlib
import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import zero
from compare import GPT
from fsdp2_port import fsdp2_collectives
from conftest import sample
from harness import run_ranks
from zerolab.models import GPTConfig


def _build(fs, base, n, **kw):
    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (n,))
    for unit in model.units():
        fs(unit, mesh=mesh, **kw)
    return model


def _torchtitan_divide_factor(rank, n):
    """torchtitan divides the loss by the global token count and calls
    set_gradient_divide_factor(1.0) on every FSDPModule (gloo: sums only, force_sum)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    runs = []
    for fs in (fully_shard, zero.fully_shard):
        model = _build(fs, base, n)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms = []
        for s in range(3):
            x, y = base.batch(4, torch.Generator().manual_seed(10 * s + rank))
            tokens = torch.tensor(float(y.numel() * n))  # the global count, as every rank knows
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                                     reduction="sum") / tokens
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
            opt.step()
            opt.zero_grad()
        runs.append((norms, {k: p.full_tensor() for k, p in model.named_parameters()}))
    (n0, p0), (n1, p1) = runs
    return all(torch.equal(a, b) for a, b in zip(n0, n1)) and all(torch.equal(p0[k], p1[k])
                                                                   for k in p0)


def test_a_divide_factor_set_on_every_fsdpmodule_is_honoured_bitwise():
    assert all(run_ranks(_torchtitan_divide_factor, 2))


def _chunked_head(rank, n):
    """torchtitan's chunked loss (components/loss.py): if the head is an FSDPModule, it is
    gathered once and kept unsynced across the chunks, and reduced once, at the last chunk."""
    torch.manual_seed(0)
    body0 = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16),
                                torch.nn.Tanh())
    head0 = torch.nn.Linear(16, 50)
    out = []
    for fs in (fully_shard, zero.fully_shard):
        body, head = copy.deepcopy(body0), copy.deepcopy(head0)
        mesh = init_device_mesh("cpu", (n,))
        fs(body, mesh=mesh)
        fs(head, mesh=mesh)
        assert isinstance(head, FSDPModule)
        x = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(rank))
        hidden = body(x)
        detached = hidden.detach().requires_grad_()  # the chunks' gradients gather here
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
        chunks = detached.chunk(3, dim=1)
        counter = fsdp2_collectives() if fs is fully_shard else _our_reduce_scatters()
        with counter as counts:
            for i, h in enumerate(chunks):
                if i == len(chunks) - 1:
                    head.set_requires_gradient_sync(True, recurse=False)
                target = x[:, i * h.shape[1] : (i + 1) * h.shape[1]]
                loss = torch.nn.functional.cross_entropy(head(h).flatten(0, 1), target.flatten())
                loss.backward()
            hidden.backward(detached.grad)
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.reshard()
        grads = {k: p.grad.full_tensor() for k, p in [*head.named_parameters(),
                                                      *body.named_parameters()]}
        out.append((grads, counts["reduce_scatter"]))
    (g0, theirs), (g1, ours) = out
    return all(torch.equal(g0[k], g1[k]) for k in g0), theirs, ours


@contextlib.contextmanager
def _our_reduce_scatters():
    counts = {}
    with zero.Ledger() as ledger:
        yield counts
    counts["reduce_scatter"] = ledger.count("reduce_scatter")


def test_the_chunked_head_is_reduced_once_like_fsdp2():
    for same, theirs, ours in run_ranks(_chunked_head, 2):
        assert same and ours == theirs == 2  # the head's once, the body's once


def _refusals(rank, n):
    out = {}
    mesh = init_device_mesh("cpu", (n,))
    cases = {
        "dp_mesh_dims": dict(dp_mesh_dims=object()),
    }
    for name, kw in cases.items():
        try:
            zero.fully_shard(GPT(GPTConfig()), mesh=mesh, **kw)
            out[name] = "accepted"
        except NotImplementedError as e:
            out[name] = str(e)
    model = zero.fully_shard(GPT(GPTConfig()), mesh=mesh,
                             mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    out["policy"] = zero.units_of(model)[0].config.param_dtype
    for name, call in {"to": lambda: model.to(torch.float64),
                       "to_empty elsewhere": lambda: model.to_empty(device="meta")}.items():
        try:
            call()
            out[name] = "accepted"
        except (NotImplementedError, RuntimeError, ValueError) as e:
            out[name] = str(e)
    return out


def test_what_is_not_supported_is_refused_by_name():
    out = run_ranks(_refusals, 2)[0]
    assert "give the data-parallel mesh itself" in out["dp_mesh_dims"]
    assert out["policy"] == torch.bfloat16
    assert "convert the model before sharding" in out["to"]
    assert "zero.init_parameters" in out["to_empty elsewhere"]


def _meta_then_to_empty(rank, n):
    """torchtitan's order: on the meta device, fully_shard, to_empty, then the model's own
    init on the DTensor parameters: as FSDP2, bitwise."""
    mesh = init_device_mesh("cpu", (n,))
    params = []
    for fs in (fully_shard, zero.fully_shard):
        with torch.device("meta"):
            model = GPT(GPTConfig())
        for unit in model.units():
            fs(unit, mesh=mesh) if fs is fully_shard else fs(unit, mesh=mesh, device="cpu")
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)  # a local draw on each rank's rows
        params.append({k: p.full_tensor() for k, p in model.named_parameters()})
    return all(torch.equal(params[0][k], params[1][k]) for k in params[0])


def test_to_empty_after_sharding_then_init_works_as_on_fsdp2():
    assert all(run_ranks(_meta_then_to_empty, 2))


def _hsdp(rank, n, mp):
    """HSDP on a 2 x 2 mesh (replicate, shard): as FSDP2's, clip included."""
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp else MixedPrecisionPolicy()
    runs = []
    for fs in (fully_shard, zero.fully_shard):
        model = copy.deepcopy(base)
        for unit in model.units():
            fs(unit, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        seen = []
        for s in range(3):
            x, y = base.batch(4, torch.Generator().manual_seed(10 * s + rank))
            loss = base.loss(model(x), y)
            loss.backward()
            seen.append((loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()))
            opt.step()
            opt.zero_grad()
        runs.append((seen, {k: p.full_tensor() for k, p in model.named_parameters()}))
    (s0, p0), (s1, p1) = runs
    return (all(torch.equal(a, b) for x, y in zip(s0, s1) for a, b in zip(x, y))
            and all(torch.equal(p0[k], p1[k]) for k in p0))


@pytest.mark.parametrize("mp", sample([True], [True, False]))
def test_hsdp_on_a_2d_mesh_is_fsdp2s(mp):
    assert all(run_ranks(_hsdp, 4, mp, timeout=120))


def _optimizer_state_dicts(rank, n, layout):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for unit in model.units():
        zero.shard(unit, stage=3, layout=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    model.loss(model(x), y).backward()
    opt.step()
    out = {}
    try:
        saved = opt.state_dict()
        out["state_dict"] = "returned"
    except RuntimeError as e:
        out["state_dict"], saved = str(e), None
    try:
        opt.load_state_dict(saved or {"state": {}, "param_groups": opt.param_groups})
        out["load"] = "loaded"
    except RuntimeError as e:
        out["load"] = str(e)
    return out


def test_the_optimizers_state_dict_over_pieces_is_refused_with_the_fix():
    out = run_ranks(_optimizer_state_dicts, 2, "flat")[0]
    assert "zero.save(path, model, opt)" in out["state_dict"]
    assert "zero.load(path, model, opt)" in out["load"]
    out = run_ranks(_optimizer_state_dicts, 2, "rows")[0]  # FSDP2's layout: DTensors, fine
    assert out == {"state_dict": "returned", "load": "loaded"}


def _ddp_state_into_pieces(rank, n):
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    plain = copy.deepcopy(base)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = base.batch(4, torch.Generator().manual_seed(rank))
    base.loss(plain(x), y).backward()
    popt.step()
    model = copy.deepcopy(base)
    for unit in model.units():
        zero.shard(unit, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(popt.state_dict())  # before the first step: torch accepts it
    base.loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "stepped"


def test_whole_tensor_state_loaded_into_pieces_is_caught_at_the_first_step():
    assert "a state dict of whole tensors (DDP's)" in run_ranks(_ddp_state_into_pieces, 2)[0]
