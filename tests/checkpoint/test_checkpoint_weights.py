"""Weights loaded on one rank only, then ``zero.shard`` (zero/surface/shard.py): every rank must hold
the same values when it shards, or each trains a model of its own.

DDP broadcasts rank 0's parameters when it is built; FSDP2's ``fully_shard`` and, before
this, ours kept each rank's own piece of whatever it held: after ``load_state_dict`` on rank 0
alone, half of every parameter was random init, silently. Now the ranks compare a
fingerprint of the values (64 elements of each parameter, 8 bytes a parameter) and raise,
naming the fix; ``sync_module_states=True`` (FSDP1's name) copies rank 0's values instead.
"""

import pytest
import torch

import zero
from compare import first_difference
from harness import run_ranks
from zerolab.models import GPT


def _trained():
    torch.manual_seed(7)  # "a checkpoint": other values than the init below
    return GPT().state_dict()


def _shard_after_rank0_loaded(rank, n, stage, sync):
    torch.manual_seed(0)
    model = GPT()
    if rank == 0:
        model.load_state_dict(_trained())  # the mistake: rank 1 keeps its init
    try:
        for unit in model.units():
            zero.shard(unit, stage=stage, **({"sync_module_states": True} if sync else {}))
    except Exception as e:  # noqa: BLE001 (the test looks at it)
        return f"{type(e).__name__}: {e}"
    return zero.full_state_dict(model)


@pytest.mark.parametrize("stage", [1, 3])
def test_weights_loaded_on_rank_0_only_are_refused_or_copied_from_rank_0(stage):
    for got in run_ranks(_shard_after_rank0_loaded, 2, stage, False):
        assert isinstance(got, str) and got.startswith("ValueError: the ranks hold different "
                                                       "values of "), got
        assert "were the weights loaded on rank 0 only?" in got
        assert "sync_module_states=True" in got
    trained = _trained()
    for got in run_ranks(_shard_after_rank0_loaded, 2, stage, True):
        assert not isinstance(got, str), got
        assert first_difference({k: got[k] for k in trained}, trained) is None


def _meta_on_one_rank(rank, n):
    with torch.device("meta" if rank == 1 else "cpu"):
        model = GPT()
    try:
        zero.shard(model.blocks[0], stage=3, device="cpu")
        return "sharded"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_a_model_on_the_meta_device_on_one_rank_only_is_refused():
    """One rank has values, the other none yet: the ranks disagree before anything moves."""
    for got in run_ranks(_meta_on_one_rank, 2):  # (the description's entry that differs)
        assert got.startswith("ValueError: Ranks shard different modules: rank 0: ('values', "
                              "False, False); rank 1: ('values', True, False)"), got
