"""zero.shard(model, auto_wrap_policy=..., sharding_strategy=...): FSDP1's one call (zero/features/wrap.py).

The units must be the ones FSDP1 makes for the same policy (FSDP1 runs on CPU and gloo, so its
own wrapping is the reference), and training must be what the same units applied by hand give.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import (ModuleWrapPolicy, lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy,
                                         transformer_auto_wrap_policy)

import zero
from compare import GPT, EncoderStack, System
from conftest import sample
from harness import run_ranks
from zerolab.models import Block

POLICIES = {
    "ModuleWrapPolicy({Block})": lambda: ModuleWrapPolicy({Block, nn.TransformerEncoderLayer}),
    "size_based(min_num_params=2000)": lambda: functools.partial(size_based_auto_wrap_policy,
                                                                 min_num_params=2000),
    "size_based(min_num_params=20000)": lambda: functools.partial(size_based_auto_wrap_policy,
                                                                  min_num_params=20000),
    "transformer_auto_wrap_policy": lambda: functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block, nn.TransformerEncoderLayer}),
    "lambda(every Linear)": lambda: functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
}
MODELS = {"gpt": GPT, "encoder": EncoderStack}


def _paths(model: nn.Module, modules) -> list[str]:
    where = {m: name for name, m in model.named_modules()}
    return [where[m] or "root" for m in modules]


def _same_units_as_fsdp1(rank, n, model_name, policy_name):
    torch.manual_seed(0)
    base = MODELS[model_name]()
    fsdp1 = FSDP(copy.deepcopy(base), auto_wrap_policy=POLICIES[policy_name](),
                 device_id=torch.device("cpu"))
    theirs = sorted(name.replace("_fsdp_wrapped_module.", "").removeprefix("_fsdp_wrapped_module")
                    or "root" for name, m in fsdp1.named_modules() if isinstance(m, FSDP))
    ours_model = copy.deepcopy(base)
    zero.shard(ours_model, stage=3, auto_wrap_policy=POLICIES[policy_name]())
    ours = sorted({p for u in zero.units_of(ours_model) for p in _paths(ours_model, u.modules)})
    return ours, theirs


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP1's deprecation, its CPU notes
@pytest.mark.parametrize("model_name,policy_name", sample(
    [("gpt", p) for p in POLICIES], [(m, p) for m in MODELS for p in POLICIES]))
def test_the_units_are_fsdp1s(model_name, policy_name):
    ours, theirs = run_ranks(_same_units_as_fsdp1, 2, model_name, policy_name)[0]
    assert ours == theirs


def _policy_vs_by_hand(rank, n, stage):
    torch.manual_seed(0)
    base = GPT()
    by_policy, by_hand = copy.deepcopy(base), copy.deepcopy(base)
    zero.shard(by_policy, stage=stage, auto_wrap_policy=ModuleWrapPolicy({Block}))
    for unit in by_hand.units():
        zero.shard(unit, stage=stage)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (by_policy, by_hand)]
    same = []
    for s in range(3):
        x, y = base.batch(4, torch.Generator().manual_seed(10 * s + rank))
        losses = []
        for m, opt in zip((by_policy, by_hand), opts):
            loss = base.loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        same.append(torch.equal(*losses))
    a, b = zero.full_state_dict(by_policy), zero.full_state_dict(by_hand)
    return same + [all(torch.equal(a[k], b[k]) for k in a)]


@pytest.mark.parametrize("stage", [2, 3])
def test_training_equals_the_same_units_by_hand(stage):
    assert all(run_ranks(_policy_vs_by_hand, 2, stage)[0])


def _strategies(rank, n):
    out = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        model = GPT()
        zero.shard(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
        out[strategy.name] = {u.config.stage.number for u in zero.units_of(model)}
    for strategy, kw in ((ShardingStrategy.HYBRID_SHARD, {}), ("SOMETHING_ELSE", {}),
                         (ShardingStrategy.FULL_SHARD, {"stage": 2})):
        try:
            zero.shard(GPT(), sharding_strategy=strategy, **kw)
            out[str(strategy)] = "accepted"
        except ValueError as e:
            out[str(strategy)] = str(e)
    return out


def test_fsdp1_strategies_map_to_stages_and_the_rest_are_refused_by_name():
    out = run_ranks(_strategies, 2)[0]
    assert out["FULL_SHARD"] == {3} and out["SHARD_GRAD_OP"] == {2}
    assert "pass mesh=init_device_mesh" in out["ShardingStrategy.HYBRID_SHARD"]
    assert "'SOMETHING_ELSE' is not one zero maps" in out["SOMETHING_ELSE"]
    assert "give one or the other" in out["ShardingStrategy.FULL_SHARD"]


def _no_shard_is_ddp(rank, n):
    torch.manual_seed(0)
    base = GPT()
    ddp = System("ddp", base, "adamw")
    ours = copy.deepcopy(base)
    zero.shard(ours, sharding_strategy=ShardingStrategy.NO_SHARD,
               auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(3):
        ddp.step(rank, s)
        gen = torch.Generator().manual_seed(1000 * s + 10 * rank)
        x, y = base.batch(4, gen)
        base.loss(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
    want, got = ddp.full_params(), zero.full_state_dict(ours)
    return all(torch.equal(want[k], got[k]) for k in want), all(
        p.numel() == q.numel() for p, q in zip(ours.parameters(), base.parameters()))


def test_no_shard_trains_like_ddp_and_holds_every_parameter_whole():
    for equal, whole in run_ranks(_no_shard_is_ddp, 2):
        assert equal and whole
