"""Measured matmuls: benchmarks/matmul_rates.py lists (and on a GPU times) the plan's own
matmul shapes; ``python -m zerolab plan --matmul-rates FILE`` prices them at the measured rates
(zerolab/measured.py). Here, without a GPU: the dry run, and synthetic rates files."""

from __future__ import annotations

import json
import os
import sys

import pytest

import test_plan  # (this folder's: pytest puts it on sys.path)
from zerolab.__main__ import main
from zerolab.clusters import PRESETS
from zerolab.roofline import EFFECTS, Roofline, effects_for, wave_efficiency

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import matmul_rates  # noqa: E402

DEEP = f"{test_plan.HERE}:deep"
SMALL = ["--seq", "16", "--batch", "2"]


def _dry(tmp_path, *argv) -> dict:
    return matmul_rates.main([*argv, "--dry-run", "--out", str(tmp_path / "dry.json")])


def _synthetic(tmp_path, res: dict, factor: float, keep=lambda row: True) -> str:
    """``res`` as if a GPU had measured every kept shape at ``factor`` x the plan's rate."""
    res = json.loads(json.dumps(res))
    res.update(measured=True, device="NVIDIA H100 80GB HBM3 (synthetic)", date="2026-12-06",
               torch="2.13.0", cuda="12.8")
    for row in res["matmuls"]:
        row["measured_tflops"] = factor * row["plan_tflops"] if keep(row) else None
    path = tmp_path / f"rates-{factor}.json"
    path.write_text(json.dumps(res))
    return str(path)


def _plan(tmp_path, *argv, model=DEEP) -> dict:
    out = tmp_path / "plan.json"
    main(["plan", "--model", model, "--world-size", "4", *SMALL, "--systems", "ddp,fsdp2",
          "--json", str(out), *argv])
    return {r["system"]: r for r in json.loads(out.read_text())}


def test_the_dry_run_lists_the_8b_examples_matmul_shapes_with_counts_and_the_plans_rate(
        tmp_path, capsys):
    """torchtitan's Llama 3.1 8B run (plan_anchors.py's): each distinct matmul of the step,
    how often forward and backward (selective checkpointing recomputes every second matmul),
    and the rate the plan charges it on h100-96gb: 989 TFLOPS at 500 W's clocks, x MAMF, x
    its tiles' waves."""
    pytest.importorskip("torchtitan")
    res = _dry(tmp_path, "--model", "torchtitan:llama3:8B", "--batch", "2", "--seq", "8192",
               "--mixed-precision", "--activation-checkpointing", "selective",
               "--cluster", "h100-96gb")
    text = capsys.readouterr().out
    assert res["measured"] is False and "DRY RUN" in text and "nothing measured" in text
    rows = {(r["m"], r["n"], r["k"], r["layout"]): r for r in res["matmuls"]}
    tokens = 2 * 8192
    # forward (x @ w.T: "NT"): the fused q/k/v, w1 and w3, w2, wo, each of 32 blocks; the head
    assert (rows[tokens, 6144, 4096, "NT"]["forward"], rows[tokens, 14336, 4096, "NT"]["forward"],
            rows[tokens, 4096, 14336, "NT"]["forward"], rows[tokens, 4096, 4096, "NT"]["forward"],
            rows[tokens, 128256, 4096, "NT"]["forward"]) == (32, 64, 32, 32, 1)
    # backward: each weight's input gradient ("NN") and weight gradient ("TN")
    assert rows[tokens, 4096, 14336, "NN"]["backward"] == 64  # w1's and w3's input gradients
    assert rows[14336, 4096, tokens, "TN"]["backward"] == 64  # w1's and w3's weight gradients
    assert rows[128256, 4096, tokens, "TN"]["backward"] == 1  # the head's weight gradient
    assert all(r["dtype"] == "bf16" and r["batch"] == 1 for r in res["matmuls"])
    assert all(r["measured_tflops"] is None for r in res["matmuls"])
    device = PRESETS["h100-96gb"].device
    rate = (device.tflops_bf16 * device.clock_factor * device.matmul_efficiency
            * wave_efficiency((1, tokens, 4096), device.sms))
    assert rows[tokens, 4096, 4096, "NT"]["plan_tflops"] == pytest.approx(rate)
    assert round(rate, 1) == 690.4
    assert f"| {tokens} x 4096 x 4096 | bf16 | NT | 32 | 32 | 549.8 |" in text
    assert os.path.exists(tmp_path / "dry.md")


def test_rates_at_half_the_plans_double_its_matmul_time_and_explain_names_them(tmp_path,
                                                                              capsys):
    res = _dry(tmp_path, "--model", DEEP, *SMALL)
    before = _plan(tmp_path)
    after = _plan(tmp_path, "--matmul-rates", _synthetic(tmp_path, res, 0.5), "--explain")
    text = capsys.readouterr().out
    for system in ("ddp", "fsdp2"):
        old, new = before[system], after[system]
        matmul = old["compute_s_by_kind"]["matmul"]
        assert new["compute_s_by_kind"]["matmul"] == pytest.approx(2 * matmul)
        assert new["compute_s"] == pytest.approx(old["compute_s"] + matmul)
        assert new["matmul_flops_measured"] == new["matmul_flops"] > 0
        causes = new["step_s_by_cause"]
        assert set(causes) == {"rated", *EFFECTS, "measured", "exposed"}
        assert causes["measured"] > 0
        assert sum(causes.values()) == pytest.approx(new["predicted_step_s"])
    explained = text.split("The step by cause")[1]
    assert "| measured matmuls |" in explained
    assert "NVIDIA H100 80GB HBM3 (synthetic), 2026-12-06, torch 2.13.0, CUDA 12.8" in explained
    # and at the plan's own rates (a GPU that ran every shape as the model says) nothing moves
    same = _plan(tmp_path, "--matmul-rates", _synthetic(tmp_path, res, 1.0))
    for system in ("ddp", "fsdp2"):
        assert same[system]["predicted_step_s"] == pytest.approx(before[system]["predicted_step_s"])


def test_a_shape_the_file_lacks_keeps_the_model_and_the_plan_says_so(tmp_path, capsys):
    res = _dry(tmp_path, "--model", DEEP, *SMALL)
    before = _plan(tmp_path)
    none = _plan(tmp_path, "--matmul-rates",
                 _synthetic(tmp_path, res, 0.5, keep=lambda row: False))
    assert "share of the matmul FLOPs measured: ddp 0%, fsdp2 0%" in capsys.readouterr().out
    for system in ("ddp", "fsdp2"):  # nothing measured: every figure the default's
        for key in ("predicted_step_s", "compute_s", "exposed_comm_s", "compute_s_by_kind"):
            assert none[system][key] == before[system][key]
    some = _plan(tmp_path, "--matmul-rates",
                 _synthetic(tmp_path, res, 0.5, keep=lambda row: row["layout"] == "NT"))
    out = capsys.readouterr().out
    assert "keep the MAMF-and-tiles rate" in out and "--model " + DEEP in out
    share = some["fsdp2"]["matmul_flops_measured"] / some["fsdp2"]["matmul_flops"]
    assert 0 < share < 1
    old = before["fsdp2"]["compute_s_by_kind"]["matmul"]
    assert old < some["fsdp2"]["compute_s_by_kind"]["matmul"] < 2 * old


def test_the_measuring_code_runs_on_the_cpu_and_the_plan_refuses_what_it_wrote(tmp_path,
                                                                               capsys):
    """--cpu-check runs what a GPU would (operands in the step's layouts, CUDA-event-like
    windows, streaming copies), so that the script is tested where there is no GPU."""
    res = matmul_rates.main(["--model", DEEP, *SMALL, "--cpu-check", "--warmup-s", "0.1",
                             "--seconds-per-shape", "0.02", "--out", str(tmp_path / "c.json")])
    assert "CPU CHECK" in capsys.readouterr().out and res["measured"] is False
    assert all(r["measured_tflops"] > 0 for r in res["matmuls"])
    assert all(r["measured_gbs"] > 0 for r in res["memory"])
    assert res["weighted"]["measured_tflops"] > 0
    with pytest.raises(SystemExit):
        _plan(tmp_path, "--matmul-rates", str(tmp_path / "c.json"))
    assert "measured nothing" in capsys.readouterr().err


def test_without_the_flag_the_plan_prices_as_before():
    device = PRESETS["dgx-h100"].device
    assert device.matmul_rates is None and effects_for(device) == EFFECTS
    assert Roofline(device).effects == frozenset(EFFECTS)


def test_a_file_from_another_model_or_dtype_or_a_dry_run_is_refused_naming_the_fix(tmp_path,
                                                                                   capsys):
    res = _dry(tmp_path, "--model", DEEP, *SMALL)
    rates = _synthetic(tmp_path, res, 0.5)

    def refused(*argv, model=DEEP) -> str:
        with pytest.raises(SystemExit) as e:
            _plan(tmp_path, *argv, model=model)
        assert e.value.code == 2
        return capsys.readouterr().err

    shallow = f"{test_plan.HERE}:shallow"
    err = refused("--matmul-rates", rates, model=shallow)
    assert f"measured for the model {DEEP}, not {shallow}" in err
    assert f"python benchmarks/matmul_rates.py --model {shallow} --batch 2 --seq 16" in err
    err = refused("--matmul-rates", rates, "--mixed-precision")
    assert "measured in fp32 (TF32), this plan's run in bf16" in err
    assert "leave out --mixed-precision" in err and "--mixed-precision --out FILE.json" in err
    err = refused("--matmul-rates", str(tmp_path / "dry.json"))
    assert "a dry run" in err and "measured nothing" in err and "on a GPU" in err
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    err = refused("--matmul-rates", str(tmp_path / "other.json"))
    assert "not a file of benchmarks/matmul_rates.py" in err
