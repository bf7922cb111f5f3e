"""Smoke test of the main job (benchmarks/compare_stages.py) at a tiny size: the invariants
its table must show, and that it writes a results file and a plot."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import compare_stages  # noqa: E402


# Small, but with blocks that outweigh the root (the tied embedding): the stages differ in
# what they keep of every unit but the ones in flight, so with one big root and two tiny
# blocks stage 2 would hold no less than stage 1. And four of them: at its worst instant
# stage 3 holds the root and two blocks gathered (one computing, one prefetched) beside two
# full gradients (one forming, one being reduced, as FSDP2 does), which with three blocks
# is as much as stage 2 holds (zerolab.memory.schedule: 1872544 B against 1857952).
LAYERS, DIM = 4, 64


@pytest.fixture(scope="module")
def rows():
    args = compare_stages.parse_args(["--layers", str(LAYERS), "--dim", str(DIM), "--seq", "16",
                                      "--batch", "2", "--steps", "1"])
    return args, {r["kind"]: r for r in compare_stages.compare(args, lead=False)}


def test_model_state_memory_falls_stage_by_stage(rows):
    _, by = rows
    peak = {k: by[k]["model_states_peak"] for k in ("ddp", "zero1", "zero2", "zero3")}
    assert peak["zero3"] < peak["zero2"] < peak["zero1"] < peak["ddp"], peak


def test_ledger_equals_torch_count_and_the_analytic_traffic(rows):
    args, by = rows
    psi = by["ddp"]["psi"]
    root = psi - LAYERS * sum(p.numel() for p in compare_stages.GPT(compare_stages.GPTConfig(
        vocab=compare_stages.VOCAB, seq=16, dim=DIM, layers=LAYERS)).blocks[0].parameters())
    ring = 1 / 2
    for kind, expected, low in [("zero1", 2, 2), ("zero2", 2, 2), ("zero3", 3, 3 - root / psi)]:
        r = by[kind]
        assert r["ledger"] == sum(r["sent"].values()), kind  # two independent counts agree
        per_psi = r["elements"] / (psi * ring)
        slack = 2 * expected * (3 * 2 + 40) / psi  # padding (units x N) and the used-mask bytes
        assert low <= per_psi <= expected + slack, (kind, per_psi)
    assert by["ddp"]["elements"] / (psi * ring) == pytest.approx(2, abs=1e-3)  # all-reduce


def test_all_systems_losses_agree_bitwise(rows):
    _, by = rows
    ref = by["ddp"]["losses_all_ranks"]
    assert all(r["losses_all_ranks"] == ref for r in by.values())


def test_writes_tables_results_file_and_plot(rows, tmp_path, capsys):
    args, by = rows
    args.out = str(tmp_path / "result.md")
    compare_stages.report.write(list(by.values()), args, ["compare_stages.py"], compare_stages.PAPER_STAGE)
    text = open(args.out).read()
    for heading in ("## Memory per rank", "## Bytes sent per rank per step", "## Step time"):
        assert heading in text
    assert "agree bitwise" in text and "torch 2." in text
    assert os.path.getsize(tmp_path / "result.png") > 10_000
