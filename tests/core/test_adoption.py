"""Parameters put in a module after ``zero.shard``: adopted as one, on every rank, or refused.

FSDP2's clients replace parameters after sharding (``load_state_dict(sd, assign=True)``,
``setattr``, HF's ``tie_weights()``), and FSDP2 adopts them (``reset_sharded_param``).
zero/core/adoption.py does the same, and holds what these tests hold:

- a tie made after sharding (``model.head.weight = model.emb.weight``) is a tie: one
  parameter, used in both places, trained bitwise as the same model tied before sharding
  (DDP's arithmetic); it used to re-point the embedding's parameter at the head's piece, and
  the embedding never trained again;
- a tie across two units, a conversion of the pieces (``.to("meta")``), a model sharded on
  meta that never got values: refused on every rank, naming the real cause;
- what one rank replaced and another did not: refused on every rank (the adoption is agreed,
  as ``zero.shard`` is); a replacement between forward and backward: refused, not dropped.
"""

import pytest
import torch
import torch.nn as nn

import zero
from harness import run_ranks

V, D = 16, 8


class Tied(nn.Module):
    """An embedding and a head, built untied: ``tie()`` ties them (HF's ``tie_weights``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.block = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)

    def tie(self):
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.block(self.emb(idx))))


def _data(rank, s):
    g = torch.Generator().manual_seed(10 * s + rank)
    return torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g)


def _train(model, rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = _data(rank, s)
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()


def _tied_after(rank, n, how, layout):
    """How: "ddp" (tied before wrapping: the reference), or zero tied after sharding."""
    torch.manual_seed(0)
    model = Tied()
    if how == "ddp":
        model.tie()
        ddp = nn.parallel.DistributedDataParallel(model)
        _train(ddp, rank)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    if how == "fully_shard":
        zero.fully_shard(model.block, layout=layout)
        zero.fully_shard(model, layout=layout)
    else:
        zero.shard(model.block, stage=3, layout=layout)
        zero.shard(model, stage=3, layout=layout)
    model.tie()  # after sharding: what HF's from_pretrained does on a distributed model
    model.tie()  # (it is called more than once; the second changes nothing)
    _train(model, rank)
    return zero.full_state_dict(model)


@pytest.mark.parametrize("how,layout", [("shard", "flat"), ("fully_shard", "rows"),
                                        ("shard", "whole")])
def test_a_tie_made_after_sharding_trains_as_the_same_tie_made_before(how, layout):
    """The embedding stopped training (0.044 off after 3 steps) with rows and fully_shard;
    with whole one rank raised and the other timed out. Now the tie trains bitwise as DDP
    with the model tied before wrapping: the head's use of the weight joins the embedding's
    parameter, and autograd sums both uses before the reduction, as DDP does."""
    ref = run_ranks(_tied_after, 2, "ddp", None)
    ours = run_ranks(_tied_after, 2, how, layout)
    for r, o in zip(ref, ours):
        assert r.keys() == o.keys()
        assert [k for k in r if not torch.equal(r[k], o[k])] == []
        assert torch.equal(o["emb.weight"], o["head.weight"])


def _tied_resumed(rank, n, layout, ckpt):
    def build():
        torch.manual_seed(0)
        model = Tied()
        zero.shard(model.block, stage=3, layout=layout)
        zero.shard(model, stage=3, layout=layout)
        model.tie()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, s):
        x, y = _data(rank, s)
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    step(model, opt, 0)
    zero.save(ckpt, model, opt)
    step(model, opt, 1)
    again, opt2 = build()
    zero.load(ckpt, again, opt2)
    step(again, opt2, 1)
    a, b = zero.full_state_dict(model), zero.full_state_dict(again)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("layout", ["flat", "rows", "whole"])
def test_a_tie_made_after_sharding_saves_and_resumes(layout, tmp_path):
    """The head's old piece, which no module holds any more, has no name in the checkpoint:
    zero.load raised KeyError on it."""
    assert run_ranks(_tied_resumed, 2, layout, str(tmp_path)) == [[], []]


class Split(Tied):
    """The embedding and the head in two different units."""


def _tied_across_units(rank, n):
    torch.manual_seed(0)
    model = Split()
    zero.shard(model.head, stage=3, layout="rows")
    zero.shard(model, stage=3, layout="rows")
    model.tie()
    try:
        model(_data(rank, 0)[0])
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "ran"


def test_a_tie_across_two_units_is_refused_naming_it():
    """It was reported as parameters "converted after zero.shard", with equal dtypes printed."""
    for message in run_ranks(_tied_across_units, 2):
        assert "converted" not in message, message
        assert "head.weight" in message and "emb.weight" in message, message
        assert "one unit" in message and "before zero.shard" in message, message


def _replaced_on(rank, n, who, when):
    torch.manual_seed(0)
    model = Tied()
    zero.shard(model.block, stage=3, layout="rows")
    zero.shard(model, stage=3, layout="rows")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data(rank, 0)
    try:
        if when == "before forward" and rank in who:
            model.tie()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if when == "before backward" and rank in who:
            model.tie()
        loss.backward()
        opt.step()
        model(x)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_a_parameter_replaced_on_one_rank_only_is_refused_on_every_rank():
    """Adoption was per rank: half the ranks trained the new parameter, half the old, silently.
    The root's forward agreement now includes what was replaced."""
    for message in run_ranks(_replaced_on, 2, (0,), "before forward"):
        assert "Disagreement" in message and "head.weight" in message, message
        assert "replaced" in message, message


def _loaded_on_rank0(rank, n):
    """torchtune's loading (DTensors, assign=True), on rank 0 only."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = Tied()
    zero.fully_shard(model.block)
    zero.fully_shard(model)
    torch.manual_seed(1)
    full = Tied().state_dict()
    sd = {k: nn.Parameter(distribute_tensor(full[k], p.device_mesh, p.placements))
          for k, p in model.state_dict().items()}
    try:
        if rank == 0:
            model.load_state_dict(sd, assign=True)
        model(_data(rank, 0)[0])
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_a_load_with_assign_on_one_rank_only_is_refused_on_every_rank():
    """The load hook adopted the new parameters at once, on that rank alone, and the next
    forward agreed on nothing: each rank trained its own model. It agrees first now."""
    for message in run_ranks(_loaded_on_rank0, 2):
        assert "Disagreement" in message and "load_state_dict" in message, message


def test_a_parameter_replaced_between_forward_and_backward_is_refused():
    """Backward put the unit's views back in the slot, and the new parameter was dropped
    without a word."""
    for message in run_ranks(_replaced_on, 2, (0, 1), "before backward"):
        assert "between forward and backward" in message and "head.weight" in message, message


def _meta(rank, n, how):
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(0)
    if how == "to meta after sharding":
        model = Tied()
        zero.shard(model.block, stage=3)
        zero.shard(model, stage=3)
        model.to("meta")
    else:  # sharded on meta, loaded without to_empty (or not at all)
        with torch.device("meta"):
            model = Tied()
        zero.fully_shard(model.block)
        zero.fully_shard(model)
        if how == "loaded on meta without to_empty":
            torch.manual_seed(1)
            full = Tied().state_dict()
            model.load_state_dict({k: distribute_tensor(full[k], p.device_mesh, p.placements)
                                   if isinstance(p, DTensor) else full[k]
                                   for k, p in model.state_dict().items()})
    try:
        model(_data(rank, 0)[0])
    except RuntimeError as e:
        return str(e)
    return "ran"


@pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")
@pytest.mark.parametrize("how", ["to meta after sharding", "loaded on meta without to_empty",
                                 "never given values"])
def test_parameters_on_meta_are_refused_naming_the_real_cause(how):
    """.to("meta") after zero.shard was "replaced by a tensor of shape (2,)"; a model sharded
    on meta and loaded without to_empty (torch warns that the copy is a no-op) was
    "converted after zero.shard"."""
    for message in run_ranks(_meta, 2, how):
        assert "meta device" in message and "converted" not in message, message
        assert "shape (" not in message, message
        if how == "to meta after sharding":
            assert "moved to the meta device after zero.shard" in message, message
        else:
            assert "to_empty" in message and "assign=True" in message, message
