"""Variants (zerolab/variants.py): a schedule of one's own measured beside the systems, and the
public check that it computes what DDP, FSDP2 or a stage computes."""

import os
import sys

import pytest
import torch

import zero
from zerolab.variants import equal_to, load, parse

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def test_a_stage_and_a_variant_are_bitwise_ddps_and_fsdp2s():
    assert equal_to("zero3", "ddp")
    verdict = equal_to("zerolab.variants:prefetch_two", "fsdp2")
    assert verdict.equal and verdict.worst == 0.0 and verdict.first is None


def test_a_variant_that_computes_otherwise_is_named_and_measured():
    half = {"stage": 2, "mp_policy": zero.MixedPrecision(torch.bfloat16, torch.float32)}
    verdict = equal_to(half, "ddp", steps=1)
    assert not verdict and verdict.worst > 0 and "after step 1" in verdict.first
    assert equal_to(half, "ddp", steps=1, tolerance=10 * verdict.worst)


def test_bad_variants_say_how_to_write_them():
    assert parse("deep=zerolab.variants:prefetch_two") == ("deep", "zerolab.variants:prefetch_two")
    for text in ("deep", "deep=nocolon", "=a:b"):
        with pytest.raises(ValueError, match="NAME=module:factory"):
            parse(text)
    with pytest.raises(ValueError, match="cannot import"):
        load("zerolab.no_such:thing")
    with pytest.raises(ValueError, match="not a dict"):
        load("zerolab.variants:_small_model")


def test_the_main_job_measures_a_variant_beside_the_systems():
    import compare_stages
    import report

    args = compare_stages.parse_args([
        "--layers", "2", "--dim", "16", "--seq", "8", "--batch", "2", "--steps", "1",
        "--systems", "ddp,zero3", "--variant", "deep=zerolab.variants:prefetch_two"])
    assert args.kinds == ["ddp", "zero3", "deep"]
    rows = compare_stages.compare(args, lead=False)
    by = {r["kind"]: r for r in rows}
    assert by["deep"]["ours"] and by["deep"]["ledger"] == sum(by["deep"]["sent"].values())
    assert by["deep"]["losses_all_ranks"] == by["zero3"]["losses_all_ranks"]
    formula = report.formula_table(rows, 2)
    assert any(line.startswith("| deep | n/a |") for line in formula)
    assert not any("deep" in line for line in report.targets_table(rows, 2))
    with pytest.raises(SystemExit):
        compare_stages.parse_args(["--variant", "zero3=zerolab.variants:prefetch_two"])
