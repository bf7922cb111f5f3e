"""CPU offload (zero/features/offload.py): the shards on the host, the copies counted, the bits unchanged.

Here host and device are the same memory, so what can be checked is what offload must not
change and what it must count: training bitwise equal to no offload, at every stage, in fp32
and in bf16 compute; each all-gather preceded by its shard's copy to the device (its master
dtype), each reduce-scatter followed by its shard's copy to the host (the reduce dtype); and
the optimizer state where the shards are. Device memory is measured by
benchmarks/device_check.py on a machine with an accelerator.
"""

import copy

import pytest
import torch

import zero
from compare import GPT, train_steps
from harness import run_ranks
from zerolab.models import GPTConfig


def _train(rank, n, stage, mp, offload, steps=3):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    for unit in model.units():
        zero.shard(unit, stage=stage, mp_policy=policy,
                   offload_policy=zero.CPUOffload() if offload else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, ledgers = train_steps(model, opt, rank, steps)
    records = ledgers[-1].records
    units = {u.name: u for u in zero.units_of(model)}
    copies = [(r.op, r.unit, r.buffer_bytes, r.sent_bytes) for r in records if r.op in ("h2d", "d2h")]
    expected = []  # each gather preceded by its h2d; each reduce-scatter followed by its d2h
    for r in records:
        if r.op == "all_gather" and r.unit in units:
            u = units[r.unit]
            expected.append(("h2d", r.unit, u.layout.shard_numel * u.sharded.element_size(), 0))
        if r.op == "reduce_scatter" and r.unit in units:
            u = units[r.unit]
            expected.append(("d2h", r.unit, u.layout.shard_numel * 4, 0))  # fp32 reduce
    states_home = {t.device.type for s in opt.state.values() for t in s.values()
                   if torch.is_tensor(t)}
    return losses, zero.full_state_dict(model), sorted(copies), sorted(expected), states_home


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_trains_bitwise_like_no_offload_and_counts_every_copy(stage, mp):
    plain = run_ranks(_train, 2, stage, mp, False)
    offloaded = run_ranks(_train, 2, stage, mp, True)
    for (l0, p0, c0, _, _), (l1, p1, c1, e1, home) in zip(plain, offloaded):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(p0[k], p1[k]) for k in p0)
        assert not c0 and c1 == e1 and c1  # none without offload; with it, the formula's
        assert home == {"cpu"}


def test_offload_at_world_size_3():
    plain, offloaded = run_ranks(_train, 3, 3, True, False), run_ranks(_train, 3, 3, True, True)
    for (l0, p0, *_), (l1, p1, *_) in zip(plain, offloaded):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(p0[k], p1[k]) for k in p0)


def _torch_policy(rank, n):
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = GPT(GPTConfig())
    zero.shard(model, stage=3, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return repr(zero.units_of(model)[0].config.offload)


def test_torchs_cpu_offload_policy_is_taken():
    assert run_ranks(_torch_policy, 2)[0] == "CPUOffload(pin_memory=False)"
