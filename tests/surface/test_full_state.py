"""``zero.load_full_state_dict`` changes only what it loads, everywhere it is asked to.

torch's ``nn.Module.load_state_dict(sd, strict=False)`` keeps the values of the keys ``sd``
lacks (a pretrained backbone, a new head: why people pass ``strict=False``) and lists them in
``missing_keys``; FSDP2's ``set_model_state_dict(..., broadcast_from_rank0=True)`` fills every
parameter from rank 0's dict and returns the keys on every rank. These hold zero to both.
"""

import pytest
import torch

import zero
from harness import run_ranks
from zerolab.models import GPT, GPTConfig

CONFIG = GPTConfig(layers=2, dim=32, vocab=64, seq=8)
DROPPED = ("blocks.1.", "ln_f.")  # a whole unit's keys, and some of the root unit's


def _partial(rank, n, layout, broadcast):
    """Load a checkpoint that lacks ``DROPPED``'s keys, strict=False; rank 0 only reads it
    with ``broadcast``. Returns the keys, and which entries of the full state are right."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for unit in model.units():
        zero.shard(unit, stage=3, layout=layout)
    torch.manual_seed(1)
    sd = {k: v for k, v in GPT(CONFIG).state_dict().items() if not k.startswith(DROPPED)}
    missing, unexpected = zero.load_full_state_dict(
        model, sd if rank == 0 or not broadcast else {}, strict=False,
        broadcast_from_rank0=broadcast)
    full = zero.full_state_dict(model)
    wrong = [k for k in full if not torch.equal(full[k], sd[k] if k in sd else before[k])]
    return sorted(missing), unexpected, wrong


@pytest.mark.parametrize("layout", ["flat", "rows", "whole"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_strict_false_keeps_the_values_of_missing_keys(layout, broadcast):
    """They were set to zero on every rank (each unit's full buffer started from zeros, and
    torch copied in only what the dict held), while missing_keys listed them. With
    broadcast_from_rank0 the other ranks got None back (unpacking raised); FSDP2 returns
    the keys on every rank."""
    torch.manual_seed(0)
    expected = sorted(k for k in GPT(CONFIG).state_dict() if k.startswith(DROPPED))
    for missing, unexpected, wrong in run_ranks(_partial, 2, layout, broadcast):
        assert missing == expected and unexpected == []
        assert wrong == []


def _outside_units(rank, n, how):
    """Weights read on rank 0 only, loaded with broadcast_from_rank0 into a model with
    parameters no unit shards: the root left unsharded, or ``ignored_params``."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if how == "no root unit":
        for block in model.blocks:
            zero.shard(block, stage=3)
    else:
        for block in model.blocks:
            zero.shard(block, stage=3)
        zero.shard(model, stage=3, ignored_params={model.ln_f.weight, model.pos_emb.weight})
    torch.manual_seed(1)
    weights = GPT(CONFIG).state_dict()  # "the file", read on rank 0
    keys = zero.load_full_state_dict(model, weights if rank == 0 else {},
                                     broadcast_from_rank0=True)
    full = zero.full_state_dict(model)
    return keys, [k for k in full if not torch.equal(full[k], weights[k])]


@pytest.mark.parametrize("how", ["no root unit", "ignored_params"])
def test_broadcast_from_rank0_reaches_parameters_outside_the_units(how):
    """Parameters of modules no unit holds, and ignored_params, kept each rank's own values:
    the ranks trained different copies of them, silently."""
    for keys, wrong in run_ranks(_outside_units, 2, how):
        assert wrong == []
        assert tuple(keys) == ([], []), keys  # (the keys, on rank 1 too)


def _from_meta(rank, n, norm: bool, broadcast: bool):
    """fully_shard on the meta device, then a full state dict loaded before any to_empty."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), *[torch.nn.BatchNorm1d(8)] * norm,
                                torch.nn.Linear(8, 4))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), *[torch.nn.BatchNorm1d(8)] * norm,
                                    torch.nn.Linear(8, 4))
    zero.fully_shard(model[0])
    zero.fully_shard(model)
    state = plain.state_dict() if rank == 0 or not broadcast else {}
    try:
        zero.load_full_state_dict(model, state, broadcast_from_rank0=broadcast)
    except RuntimeError as e:
        return str(e)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    return torch.equal(model(x), plain(x)) and not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("broadcast", [True, False])
def test_a_model_sharded_on_meta_takes_a_full_state_dict_as_on_fsdp2(broadcast):
    """Its shards take the values and its parameters leave the meta device (the forward
    refused, "still on the meta device", after a load that had given them values); buffers
    that no unit shards and that are still on meta are named, with to_empty as the fix."""
    assert run_ranks(_from_meta, 2, False, broadcast) == [True, True]
    for said in run_ranks(_from_meta, 2, True, broadcast):
        assert "1.running_mean" in said and "to_empty(device=...) first" in said, said
