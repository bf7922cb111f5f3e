"""The benchmark command lines refuse bad input while parsing: argparse's usage error (exit
code 2) with one line that says what is allowed, before any rank or simulation starts. Each
case below was once a traceback, a run that printed nothing useful, or a run with no bound."""

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import argtypes  # noqa: E402
import compare_stages  # noqa: E402
import simulate  # noqa: E402
import timeline  # noqa: E402

SCRIPTS = {"compare_stages": compare_stages, "simulate": simulate, "timeline": timeline}
BIG = ["--dim", "1048576", "--layers", "1000"]  # 13e15 parameters: no machine has the memory

CASES = [  # (script, argv, the message after "error: ")
    ("compare_stages", ["--world-size", "0"],
     "argument --world-size: must be an integer from 1 to 64, got '0'"),
    ("compare_stages", ["--world-size", "-2"],
     "argument --world-size: must be an integer from 1 to 64, got '-2'"),
    ("compare_stages", ["--world-size", "65"],
     "argument --world-size: must be an integer from 1 to 64, got '65'"),
    ("compare_stages", ["--dim", "0"], "argument --dim: must be an integer >= 1, got '0'"),
    ("compare_stages", ["--dim", "30"],
     "--dim must be a multiple of the number of heads (4), got 30"),
    ("compare_stages", ["--batch", "0"], "argument --batch: must be an integer >= 1, got '0'"),
    ("compare_stages", ["--seq", "0"], "argument --seq: must be an integer >= 1, got '0'"),
    ("compare_stages", ["--layers", "0"], "argument --layers: must be an integer >= 1, got '0'"),
    ("compare_stages", ["--layers", "two"],
     "argument --layers: must be an integer >= 1, got 'two'"),
    ("compare_stages", ["--steps", "1001"],
     "argument --steps: must be an integer from 0 to 1,000, got '1001'"),
    ("compare_stages", ["--steps", "0"], "--steps must be >= 1 (or pass --no-time)"),
    ("compare_stages", ["--systems", "zero4"],
     "argument --systems: must be a comma list of distinct values from ddp, ddp+zro, zero1, "
     "zero2, zero3, fsdp2-noreshard, fsdp2, zero3-offload, zero3-disk, zero3-qwz, zero3-qgz, "
     "got 'zero4'"),
    ("compare_stages", ["--systems", "ddp,ddp"],
     "argument --systems: must be a comma list of distinct values from ddp, ddp+zro, zero1, "
     "zero2, zero3, fsdp2-noreshard, fsdp2, zero3-offload, zero3-disk, zero3-qwz, zero3-qgz, "
     "got 'ddp,ddp'"),
    ("compare_stages", ["--systems", "zero3-qgz"],
     "zero3-qgz plays nodes of 2 ranks and needs 2 nodes or more: pass --world-size 4 (or "
     "another even number >= 4), not 2"),
    ("compare_stages", ["--device", "tpu"],
     "argument --device: invalid choice: 'tpu' (choose from 'cpu', 'cuda')"),
    ("compare_stages", ["--out", "{tmp}"],
     "argument --out: must be a file path, got the directory '{tmp}'"),
    ("compare_stages", ["--out", "{tmp}/file/x.md"],
     "argument --out: must be a file path this user can write, got '{tmp}/file/x.md'"),
    ("compare_stages", BIG, "the run needs at least"),
    ("simulate", ["--stage", "4"],
     "argument --stage: must be a comma list of distinct values from 1, 2, 3, got '4'"),
    ("simulate", ["--stage", "x"],
     "argument --stage: must be a comma list of distinct values from 1, 2, 3, got 'x'"),
    ("simulate", ["--stage", "1,,3"],
     "argument --stage: must be a comma list of distinct values from 1, 2, 3, got '1,,3'"),
    ("simulate", ["--params", "0"],
     "argument --params: must be a number > 0 and <= 2e+12, got '0'"),
    ("simulate", ["--params", "-5"],
     "argument --params: must be a number > 0 and <= 2e+12, got '-5'"),
    ("simulate", ["--params", "1e15"],
     "argument --params: must be a number > 0 and <= 2e+12, got '1e15'"),
    ("simulate", ["--params", "nan"],
     "argument --params: must be a number > 0 and <= 2e+12, got 'nan'"),
    ("simulate", ["--params", "inf"],
     "argument --params: must be a number > 0 and <= 2e+12, got 'inf'"),
    ("simulate", ["--world-size", "0"],
     "argument --world-size: must be an integer from 1 to 1,000,000, got '0'"),
    ("simulate", ["--world-size", "1000000000"],
     "argument --world-size: must be an integer from 1 to 1,000,000, got '1000000000'"),
    ("simulate", ["--rank", "-1"], "argument --rank: must be an integer >= 0, got '-1'"),
    ("simulate", ["--rank", "64"], "--rank must be in [0, 64)"),
    ("simulate", ["--table2", "--memory", "-1"],
     "argument --memory: must be a number > 0 and <= 5e+11, got '-1'"),
    ("simulate", ["--table2", "--memory", "1e20"],
     "argument --memory: must be a number > 0 and <= 5e+11, got '1e20'"),
    ("simulate", ["--table1", "--table2"], "argument --table2: not allowed with argument --table1"),
    ("simulate", ["--json", "--table1"], "argument --table1: not allowed with argument --json"),
    ("timeline", ["--systems", "ddp,zero4"],
     "argument --systems: must be a comma list of distinct values from ddp, ddp+zro, zero1, "
     "zero2, zero3, fsdp2-noreshard, fsdp2, got 'ddp,zero4'"),
    ("timeline", ["--dim", "30"], "--dim must be a multiple of the number of heads (4), got 30"),
    ("timeline", ["--layers", "0"], "argument --layers: must be an integer >= 1, got '0'"),
    ("timeline", ["--png", "{tmp}"],
     "argument --png: must be a file path, got the directory '{tmp}'"),
    ("timeline", BIG, "the run needs at least"),
]


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """A refused command line must stop before any rank or simulation starts."""
    def started(*args, **kwargs):
        raise AssertionError("a run started")
    monkeypatch.setattr(compare_stages, "run_system", started)
    monkeypatch.setattr(simulate, "simulate", started)
    monkeypatch.setattr(timeline, "run_ranks", started)


def refusal(script, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        SCRIPTS[script].main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("script, argv, message", CASES,
                         ids=[f"{s} {' '.join(a)}".replace("{tmp}", "DIR") for s, a, _ in CASES])
def test_bad_argument_is_refused_with_what_is_allowed(script, argv, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")  # a file where a directory should be
    argv = [a.format(tmp=tmp_path) for a in argv]
    line = refusal(script, argv, capsys)
    assert "error: " + message.format(tmp=tmp_path) in line, line


def test_cuda_without_a_gpu_says_so_and_how_the_gpu_path_runs(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    line = refusal("compare_stages", ["--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is available" in line, line
    assert "under torchrun with NCCL" in line and "--nproc-per-node" in line, line


def test_the_memory_refusal_names_the_sizes(capsys):
    line = refusal("compare_stages", BIG, capsys)
    psi = compare_stages.gpt_params(compare_stages.VOCAB, compare_stages.SEQ, 1048576, 1000)
    assert f"Ψ = {psi:,} parameters" in line and "on 2 local ranks" in line, line


def test_gpt_params_counts_what_the_model_holds():
    cfg = compare_stages.GPTConfig(vocab=96, seq=16, dim=32, layers=3)
    model = compare_stages.GPT(cfg)
    assert compare_stages.gpt_params(96, 16, 32, 3) == sum(p.numel() for p in model.parameters())


def test_good_arguments_pass():
    args = compare_stages.parse_args(["--world-size", "4", "--systems", "ddp, zero3",
                                      "--steps", "0", "--no-time", "--dim", "64"])
    assert (args.world_size, args.kinds, args.dim) == (4, ["ddp", "zero3"], 64)
    assert compare_stages.parse_args([]).kinds == list(compare_stages.KINDS)
    assert argtypes.float_in(0, simulate.MAX_PARAMS)("7.5e9") == 7.5e9
    assert argtypes.comma_list((1, 2, 3), int)("3,1") == [3, 1]
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.int_in(1, 8)("1.5")
