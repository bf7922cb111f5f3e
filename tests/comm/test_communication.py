"""What each stage sends per step and rank, read from the ledger (zero/comm/collectives.py).

Ψ = parameter count; each rank sends (N-1)/N of every all-gathered or reduce-scattered
buffer (ring accounting). Stages 1 and 2: one reduce-scatter of each unit's padded flat
gradient and one all-gather of its parameters = 2Ψ. Stage 3: an all-gather per unit in
forward and again in backward (not for the root, which keeps its parameters), and one
reduce-scatter per unit = 3Ψ less the root's backward gather.
"""

import pytest
import torch

import zero
from harness import run_ranks
from zerolab.models import GPT, GPTConfig


def _one_step(rank, n, stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, dim=24, vocab=50, seq=8))
    for unit in model.units():
        zero.shard(unit, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        x, y = model.batch(2, torch.Generator().manual_seed(rank))
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    with zero.Ledger() as ledger:
        step()
    units = zero.units_of(model)
    return {
        "records": [(r.op, r.unit, r.phase, r.buffer_bytes, r.sent_bytes, r.dtype)
                    for r in ledger.records],
        "padded": {u.name: u.layout.padded_numel for u in units},
        "psi": sum(u.layout.numel for u in units),
        "params": sum(p.numel() for p in GPT(GPTConfig(layers=4, dim=24, vocab=50, seq=8)).parameters()),
    }


def _by(records, op, phase=None):
    return sorted((r[1], r[3]) for r in records if r[0] == op and (phase is None or r[2] == phase))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collectives_per_step_and_total_traffic(stage, n):
    out = run_ranks(_one_step, n, stage)[0]
    rec, padded = out["records"], out["padded"]
    assert out["psi"] == out["params"]  # every parameter is in exactly one unit
    every_unit = sorted((u, 4 * p) for u, p in padded.items())
    assert _by(rec, "reduce_scatter", "backward") == every_unit
    assert _by(rec, "reduce_scatter") == every_unit  # and none elsewhere
    if stage in (1, 2):
        assert _by(rec, "all_gather", "step") == every_unit
        assert _by(rec, "all_gather") == every_unit
        expected_psi = 2
    else:
        assert _by(rec, "all_gather", "forward") == every_unit
        assert _by(rec, "all_gather", "backward") == [x for x in every_unit if x[0] != "root"]
        expected_psi = 3
    # The only other collectives: one all-reduce of a byte per parameter tensor ("used?"),
    # and the agreements (zero/comm/collectives.py): one as the forward starts, and in check mode one
    # before every other collective; each all-gathers two int64 per rank.
    others = [r for r in rec if r[0] == "all_reduce"]
    assert len(others) == 1 and others[0][5] == torch.uint8 and others[0][2] == "backward"
    agreements = [r for r in rec if r[0] == "agree"]
    data = [r for r in rec if r[0] != "agree"]
    assert len(agreements) == 1 + (len(data) if zero.comm.checking() else 0)
    assert all(r[3] == 16 * n and r[5] == torch.int64 for r in agreements)

    ring = (n - 1) / n
    rec = data
    sent = sum(r[4] for r in rec if r[0] != "all_reduce")
    full_units = sum(padded.values())
    if stage == 3:
        full_units = 3 * full_units - padded["root"]  # the root is not gathered again
    else:
        full_units = 2 * full_units
    assert abs(sent - 4 * ring * full_units) <= len(rec)  # int() truncation per record
    ratio = sent / (4 * ring * out["psi"])  # traffic in units of Ψ
    root_share = padded["root"] / out["psi"]
    padding = (sum(padded.values()) - out["psi"]) / out["psi"]
    assert expected_psi - (root_share if stage == 3 else 0) <= ratio + 1e-9
    assert ratio <= expected_psi * (1 + padding) + 1e-9
