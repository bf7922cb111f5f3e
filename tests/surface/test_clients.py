"""Patterns of FSDP2's other clients (torchtune, accelerate, Lightning, the HF Trainer), on
zero: what they do next to sharding that torchtitan does not.

- Optimizer in backward (torchtune's ``optimizer_in_bwd=True``): a
  ``register_post_accumulate_grad_hook`` on each sharded parameter steps that parameter's own
  optimizer. FSDP2 runs those hooks with the reduced sharded gradient, once per backward
  (``foreach_reduce``); so does zero, when it hands the gradient shards out.
"""

import pytest
import torch

import zero
from harness import run_ranks
from zerolab.models import GPT, GPTConfig


def _model(stage, layout):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8))
    for unit in model.units():
        zero.shard(unit, stage=stage, layout=layout)
    return model


def _train(rank, n, stage, layout, in_backward):
    model = _model(stage, layout)
    calls = []
    if in_backward:  # torchtune's pattern: one optimizer per parameter, stepped in its hook
        opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

        def step(p):
            calls.append(p.numel())
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        x, y = model.batch(2, torch.Generator().manual_seed(10 * s + rank))
        model.loss(model(x), y).backward()
        if not in_backward:
            opt.step()
            opt.zero_grad()
    return zero.full_state_dict(model), len(calls), len(list(model.parameters()))


@pytest.mark.parametrize("stage,layout", [(1, "flat"), (3, "flat"), (3, "rows")])
def test_optimizer_in_backward_trains_as_a_step_after_backward(stage, layout):
    plain = run_ranks(_train, 2, stage, layout, False)
    hooked = run_ranks(_train, 2, stage, layout, True)
    for (p, _, _), (h, calls, params) in zip(plain, hooked):
        assert calls == 3 * params  # once per parameter and backward, as FSDP2's
        assert all(torch.equal(p[k], h[k]) for k in p)


def _one_parameter_units(rank, n, in_backward):
    """Units of one parameter each, layout "whole": each unit lives on one rank, and the other
    holds none of it; optimizer in backward, or one step after backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2))
    for unit in (model[0], model[2], model):
        zero.shard(unit, stage=3, layout="whole")
    calls, opts = [], {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

    def step(p):
        calls.append(p.numel())
        opts[p].step()
        opts[p].zero_grad()

    if in_backward:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
    for s in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        model(x).square().mean().backward()
        if not in_backward:
            for p in model.parameters():
                step(p)
    return zero.full_state_dict(model), len(calls)


def test_optimizer_in_backward_with_layout_whole_steps_on_every_rank():
    """A rank that holds none of a parameter gets no gradient, so its hook never ran and its
    optimizer never marked the unit stepped: the next forward raised a Disagreement that
    blamed the user. The hooks now run on every rank, as a step after backward does."""
    plain = run_ranks(_one_parameter_units, 2, False)
    hooked = run_ranks(_one_parameter_units, 2, True)
    for (p, steps), (h, calls) in zip(plain, hooked):
        assert calls == steps == 3 * 4  # every parameter's hook, on every rank, every backward
        assert all(torch.equal(p[k], h[k]) for k in p)


# ---- Lightning's model.to(device), the HF Trainer's register_fsdp_forward_method ------------


class _Generator(torch.nn.Module):
    """A method other than forward that runs the model (HF's ``generate``)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)

    def generate(self, x, steps=3):
        outs = []
        for _ in range(steps):
            x = self(x)
            outs.append(x)
        return torch.stack(outs)


def _clients(rank, n, which):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method

    shard = torch_fully_shard if which == "torch" else zero.fully_shard
    torch.manual_seed(0)
    model = _Generator()
    for m in [*model.blocks, model]:
        shard(m)
    out = {}
    try:  # Lightning's ModelParallelStrategy.setup: to the device it is already on
        out["to"] = model.to(torch.device("cpu")) is model
    except RuntimeError as e:
        out["to"] = str(e)
    register_fsdp_forward_method(model, "generate")  # the HF Trainer's call
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out["generate"] = model.generate(x)
    if which == "zero":  # (FSDP2 converts its DTensors; zero's pieces view its shards)
        try:
            model.to(torch.float64)
            out["to_double"] = "converted"
        except RuntimeError as e:
            out["to_double"] = "refused" if "after zero.fully_shard" in str(e) else str(e)
    return out


def test_to_its_own_device_is_accepted_and_generate_runs_as_on_fsdp2():
    ours, theirs = run_ranks(_clients, 2, "zero"), run_ranks(_clients, 2, "torch")
    for o, t in zip(ours, theirs):
        assert o["to"] is True and t["to"] is True, (o["to"], t["to"])
        assert o["to_double"] == "refused"  # a conversion still is: it would detach the shards
        assert torch.equal(o["generate"], t["generate"])


def _flat_warns(rank, n):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zero.fully_shard(torch.nn.Linear(4, 4), layout="flat")
        flat = [str(w.message) for w in seen]
        zero.fully_shard(torch.nn.Linear(4, 4))
    return flat, [str(w.message) for w in seen[len(flat):]]


def test_fully_shard_with_a_layout_torchs_clipping_misreads_says_so():
    """accelerate, the HF Trainer, Lightning and torchtune clip with torch's clip_grad_norm_:
    on layout 'flat' each rank clipped by its own share's norm (1.734 and 1.156 against the
    global 2.084), silently. fully_shard says so, naming the two ways that are right."""
    for flat, rows in run_ranks(_flat_warns, 2):
        assert any("zero.clip_grad_norm_" in m and "layout='rows'" in m for m in flat), flat
        assert rows == [], rows  # FSDP2's layout: torch's clipping is right there


# ---- a parameter replaced after sharding (FSDP2's standard loading) ---------------------------


def _two_steps(model, rank) -> None:
    """Two AdamW steps on each rank's own batch (the same everywhere for both systems)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _replaced(rank, n, which, how):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    shard = torch_fully_shard if which == "torch" else zero.fully_shard
    torch.manual_seed(0)
    model = _Generator()
    for m in [*model.blocks, model]:
        shard(m)
    torch.manual_seed(1)
    full = _Generator().state_dict()  # the checkpoint's full weights
    if how == "assign":  # torchtune's recipes, accelerate's cpu_ram_efficient_loading
        sd = {}
        for name, p in model.state_dict().items():
            sd[name] = torch.nn.Parameter(distribute_tensor(full[name], p.device_mesh,
                                                            p.placements))
        model.load_state_dict(sd, assign=True)
    else:  # transformers' distributed loading: setattr on the module, a DTensor parameter
        for name, p in list(model.named_parameters()):
            owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            setattr(owner, attr, torch.nn.Parameter(distribute_tensor(
                full[name], p.device_mesh, p.placements)))
    _two_steps(model, rank)
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["assign", "setattr"])
def test_a_parameter_replaced_after_sharding_is_adopted_as_fsdp2_does(how):
    ours, theirs = run_ranks(_replaced, 2, "zero", how), run_ranks(_replaced, 2, "torch", how)
    for o, t in zip(ours, theirs):
        assert o.keys() == t.keys() and all(torch.equal(o[k], t[k]) for k in o)


# ---- a model sharded on the meta device stays there until to_empty ---------------------------


def _from_meta(rank, n, which, how):
    """Lightning's ModelParallelStrategy: build under the meta device, shard (the user's
    configure_model), then, if any parameter is still on meta, ``to_empty`` and each
    submodule's ``reset_parameters``; torchtune: shard on meta, load with assign=True."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    shard = torch_fully_shard if which == "torch" else zero.fully_shard
    with torch.device("meta"):
        model = _Generator()
    for m in [*model.blocks, model]:
        shard(m)
    on_meta = [p.is_meta for p in model.parameters()]
    if how == "lightning":
        if any(on_meta):  # Lightning's _has_meta_device_parameters_or_buffers
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    else:
        torch.manual_seed(1)
        full = _Generator().state_dict()
        model.load_state_dict({k: torch.nn.Parameter(distribute_tensor(
            full[k], p.device_mesh, p.placements)) for k, p in model.state_dict().items()},
            assign=True)
    _two_steps(model, rank)
    return on_meta, {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for k, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["lightning", "torchtune"])
def test_a_model_sharded_on_meta_stays_on_meta_until_to_empty_as_on_fsdp2(how):
    """Lightning asks "is anything still on meta?" before it calls to_empty and
    reset_parameters: zero's shards were real (zero-filled) CPU tensors, so it skipped both and
    the first forward refused to run. Now the parameters are on meta until to_empty or a load,
    and the run is FSDP2's, bitwise."""
    ours, theirs = run_ranks(_from_meta, 2, "zero", how), run_ranks(_from_meta, 2, "torch", how)
    for (o_meta, o), (t_meta, t) in zip(ours, theirs):
        assert o_meta == t_meta and all(t_meta)
        assert o.keys() == t.keys() and all(torch.equal(o[k], t[k]) for k in o)
