"""ZeRO++'s qwZ (zero/features/quantized.py): int8 weight all-gathers, the bytes and the error bounded.

Lossy by design: the test holds the bound (each gathered weight within half a quantization
step, its block's largest magnitude over 254, of the exact one), the bytes to the byte (1 per
element and 4 per block's scale, ring accounting), and what it must not touch: the fp32
master shards. The loss curve against unquantized training is in benchmarks/family.py's
results.
"""

import pytest
import torch

import zero
from compare import GPT, train_steps
from harness import run_ranks
from zero.features.quantized import QuantizedWeights
from zerolab.models import GPTConfig


def _gather_error(rank, n, block):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for unit in model.units():
        zero.shard(unit, stage=3, comm_policy=QuantizedWeights(block))
    units = zero.units_of(model)
    worst = 0.0
    with zero.Ledger() as ledger:
        for u in units:
            u.unshard(phase="other")
            full = u.held().unsharded.detach().clone()
            u.reshard()
            # the exact full buffer, from every rank's master shard, and each element's bound
            shards = [torch.empty_like(u.sharded) for _ in range(n)]
            torch.distributed.all_gather(shards, u.sharded)  # (outside the ledger: not ours)
            want = torch.cat(shards)
            bound = torch.empty_like(want)
            s = u.layout.shard_numel
            nb = -(-s // block)
            for r in range(n):
                x = torch.zeros(nb * block)
                x[:s] = want[r * s : (r + 1) * s]
                m = x.view(nb, block).abs().amax(1) / 254
                bound[r * s : (r + 1) * s] = m.repeat_interleave(block)[:s]
            err = (full - want).abs()
            worst = max(worst, (err - bound).max().item())
    gathers = [(r.dtype, r.buffer_bytes, r.sent_bytes) for r in ledger.records
               if r.op == "all_gather"]
    return worst, gathers, [u.layout.shard_numel for u in units]


@pytest.mark.parametrize("block", [256, 64])
def test_every_gathered_weight_is_within_half_a_step_and_bytes_are_the_formula(block):
    for worst, gathers, shard_sizes in run_ranks(_gather_error, 2, block):
        assert worst <= 1e-7  # |w' - w| <= max|block| / 254 (+ fp32 rounding of q * scale)
        n = 2
        expected = []
        for s in shard_sizes:
            nb = -(-s // block)
            message = nb * block + 4 * nb  # bytes a rank: a code an element, 4 a block's scale
            expected.append((torch.uint8, n * message, (n - 1) * message))
        assert gathers == expected


def _train(rank, n, quantized, steps=3):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for unit in model.units():
        zero.shard(unit, stage=3, comm_policy=QuantizedWeights() if quantized else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return [loss.item() for loss in train_steps(model, opt, rank, steps)[0]]


def test_quantized_training_follows_unquantized_within_two_percent():
    plain, quantized = run_ranks(_train, 2, False)[0], run_ranks(_train, 2, True)[0]
    assert quantized != plain  # lossy: it is quantizing
    assert all(abs(a - b) / abs(a) < 2e-2 for a, b in zip(plain, quantized)), (plain, quantized)


def _in_place(rank, n):
    try:
        zero.shard(GPT(GPTConfig()), stage=2, comm_policy=QuantizedWeights())
    except ValueError as e:
        return str(e)
    return "accepted"


def test_stage_1_2_without_a_cast_is_refused():
    assert "needs the shard apart from the full buffer" in run_ranks(_in_place, 2)[0]
