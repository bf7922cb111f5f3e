"""FSDP2's state-dict scenarios (test_fully_shard_state_dict.py), ported.

FSDP2's ``model.state_dict()`` holds each rank's DTensor shards and ``load_state_dict`` writes
them back. Ours refuses both on a sharded module (they would hand out this rank's 1-D pieces
under the full names): the model's state goes through ``zero.full_state_dict`` /
``zero.load_full_state_dict`` (FSDP2's ``get_model_state_dict``/``set_model_state_dict`` with
``full_state_dict=True``) or ``zero.save``/``zero.load`` (sharded, tests/checkpoint/test_checkpoint.py). So
the round trip of torch's test is ported onto those, with the checks that matter: every key,
the loaded values in place, and the next forward computing with them.
"""

import copy

import torch
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

import zero
from fsdp2_port import data, zero_shard_units
from harness import run_ranks


def mlp_model(dim: int) -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(MLP(dim), nn.Sequential(MLP(dim), nn.Linear(dim, dim)), MLP(dim))


def sharded(base, stage, raf=None):
    model = copy.deepcopy(base)
    zero_shard_units([model[0], model[1], model[2], model], stage, raf=raf)
    return model


def filled(model: nn.Module, value: float) -> nn.Module:
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _save_load(rank, n):
    out = []
    for stage in (1, 2, 3):
        for dim in (2, 3, 5):  # uneven: some ranks hold padding or empty pieces
            where = f"zero{stage} dim {dim}"
            base = mlp_model(dim)
            model = sharded(base, stage, raf=False if stage == 3 else None)
            x = data(rank, 0, 2, dim)
            model(x)  # after a forward that kept the parameters (torch checks this case)
            full = zero.full_state_dict(model)
            if list(full) != list(base.state_dict()):
                out.append(f"{where}: keys {sorted(full)}")
            out += [f"{where}: {k} differs" for k, v in base.state_dict().items()
                    if not torch.equal(full[k], v)]
            ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
            new = filled(base, 42.0)
            zero.load_full_state_dict(model, new.state_dict())
            out += [f"{where}: {k} moved" for k, p in model.named_parameters()
                    if p.data_ptr() != ptrs[k]]  # loaded in place, into the shards
            out += [f"{where}: {k} not loaded" for k, p in model.named_parameters()
                    if not torch.equal(p.detach(), torch.full_like(p, 42.0))]
            if not torch.equal(model(x), new(x)):
                out.append(f"{where}: the next forward does not use the loaded values")
    return out


def test_full_state_dict_save_load():
    # Ports TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load (mlp_dim 2, 3, 5;
    # at stage 3 also reshard_after_forward=False after a forward) with the full state dict.
    assert run_ranks(_save_load, 2) == [[], []]


def _in_place_writes(rank, n):
    base = mlp_model(3)
    x = data(rank, 0, 2, 3)
    out = []
    for stage in (1, 2, 3):
        model = sharded(base, stage)
        model(x).sum().backward()  # a trained-on model, not a fresh one
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
        if not torch.equal(model(x), filled(base, 0.5)(x)):
            out.append(f"zero{stage}: the next forward does not use the written values")
    return out


def test_forward_after_in_place_writes_uses_the_written_values():
    # What torch's test does to its sharded parameters (``param.fill_`` under no_grad): the
    # model then computes with the written values, at every stage (the full parameters of
    # stages 1 and 2 are refreshed; a bug this suite found, fixed in 13dab96).
    assert run_ranks(_in_place_writes, 2) == [[], []]


def _full_state_dict(rank, n):
    torch.manual_seed(42)
    ref = Transformer(ModelArgs(dropout_p=0.0))
    out = []
    for stage in (1, 2, 3):
        model = copy.deepcopy(ref)
        zero_shard_units([*[m for m in model.modules() if isinstance(m, TransformerBlock)], model],
                         stage)
        full, expected = zero.full_state_dict(model), ref.state_dict()
        if list(full) != list(expected):
            out.append(f"zero{stage}: keys {sorted(set(full) ^ set(expected))}")
        out += [f"zero{stage}: {k}" for k in expected
                if k in full and not torch.equal(full[k], expected[k])]
    return out


def test_full_state_dict_equals_the_unsharded_state_dict():
    # Ports TestFullyShardStateDictMultiThread.test_rank0_offload_full_state_dict: the full
    # state dict has the unsharded model's keys in its order (the tied output.weight too) and
    # values (issue 11 case 7, fixed in b7b0865). torch keeps it on rank 0 only; ours is on
    # every rank.
    assert run_ranks(_full_state_dict, 2) == [[], []]


# ---- weights read on rank 0 only --------------------------------------------------------------


def _rank0_only(rank, n, broadcast):
    from zerolab.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8))
    for unit in model.units():
        zero.shard(unit, stage=3)
    torch.manual_seed(1)
    weights = GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8)).state_dict()  # "the file"
    torch.manual_seed(100 + rank)  # the other ranks' own initial values
    mine = weights if rank == 0 else GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8)).state_dict()
    try:
        if broadcast:
            zero.load_full_state_dict(model, mine if rank == 0 else {},
                                      broadcast_from_rank0=True)
        else:
            zero.load_full_state_dict(model, mine)
    except ValueError as e:
        return str(e)
    full = zero.full_state_dict(model)
    return all(torch.equal(full[k], weights[k]) for k in full)


def test_weights_read_on_rank0_only_raise_or_are_broadcast():
    """Every rank calls it, the others passing their own initial values: that trained half the
    model as rank 0's weights and half as each rank's init, silently. Now it raises on every
    rank, naming broadcast_from_rank0 (FSDP2's name), which loads rank 0's everywhere."""
    for said in run_ranks(_rank0_only, 2, False):
        assert isinstance(said, str) and "broadcast_from_rank0=True" in said, said
    assert run_ranks(_rank0_only, 2, True) == [True, True]
