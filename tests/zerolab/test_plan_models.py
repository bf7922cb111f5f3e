"""``python -m zerolab plan`` on Hugging Face configs with the transformers the test extra installs,
the choices the answer hinges on, and input meant to break it."""

from __future__ import annotations

import json
import sys

import pytest

from zerolab.__main__ import main
from zerolab.planmodel import MAX_LAYERS

pytest.importorskip("transformers")

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
T5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 32,
      "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
      "vocab_size": 64, "relative_attention_num_buckets": 8, "decoder_start_token_id": 0,
      "pad_token_id": 0, "tie_word_embeddings": False}


def config(tmp_path, fields: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return str(path)


def plan(tmp_path, capsys, *argv, n: int = 4) -> tuple[dict, str]:
    out = tmp_path / "plan.json"
    main(["plan", "--world-size", str(n), "--seq", "16", "--batch", "2", "--json", str(out), *argv])
    return {r["system"]: r for r in json.loads(out.read_text())}, capsys.readouterr().out


def error_of(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--world-size", "4", "--seq", "16", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    return err


def test_a_llama_config_is_planned_as_training_runs_it(tmp_path, capsys):
    """The transformers of the test extra builds it; model FLOPs follow the convention MFU
    counts by (6 a linear weight a token, 12 x layers x seq x hidden for attention), and the
    config is planned with its key-value cache off."""
    rows, text = plan(tmp_path, capsys, "--model", config(tmp_path, LLAMA), "--systems", "fsdp2",
                      "--activation-checkpointing", "selective")  # (its own test: full matrix)
    assert "use_cache off" in text and "selective activation checkpointing" in text
    linear = (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) * 2 + 64 * 32  # q,o k,v; mlp; x2; head
    for r in rows.values():
        assert r["model_flops_per_token"] == 6 * linear + 12 * 2 * 16 * 32
        assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * 16 / r["predicted_step_s"])


def test_compare_stages_measures_a_llama_config_beside_the_plan(tmp_path, monkeypatch):
    """Two real ranks: model states and every byte sent as predicted; our one agreement a step
    included (ZERO_CHECK=1, the tests' default, agrees before every collective instead)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "benchmarks"))
    import compare_stages

    monkeypatch.setenv("ZERO_CHECK", "0")
    out = tmp_path / "m.json"
    compare_stages.main(["--model", config(tmp_path, LLAMA), "--seq", "16", "--batch", "2",
                         "--no-time", "--systems", "zero3", "--out", str(tmp_path / "r.md"),
                         "--json", str(out)])
    (r,) = json.loads(out.read_text())
    p = r["predicted"]
    assert r["model_state_bytes_per_rank"] == p["model_state_bytes_per_rank"]
    assert r["bytes_sent_per_rank_per_step"] == p["bytes_sent_per_rank_per_step"]
    assert p["agreement_bytes_per_rank_per_step"] == r["agreement_bytes_per_rank_per_step"] == 16


@pytest.mark.full
def test_selective_checkpointing_sits_between_none_and_full(tmp_path, capsys):
    """torchtitan's per-op policy keeps matmuls' and attention's outputs (not every second
    matmul's) and recomputes the rest: memory and FLOPs between no checkpointing and whole."""
    spec = ("--model", config(tmp_path, LLAMA), "--systems", "zero3")
    none, _ = plan(tmp_path, capsys, *spec)
    sel, text = plan(tmp_path, capsys, *spec, "--activation-checkpointing", "selective")
    full, _ = plan(tmp_path, capsys, *spec, "--activation-checkpointing")
    assert "selective activation checkpointing" in text
    peak = [r["zero3"]["peak_bytes_per_rank"] for r in (none, sel, full)]
    flops = [r["zero3"]["flops_per_rank_per_step"] for r in (none, sel, full)]
    assert peak[0] > peak[1] > peak[2] and flops[0] < flops[1] < flops[2]
    assert len({r["zero3"]["model_flops_per_token"] for r in (none, sel, full)}) == 1


@pytest.mark.full
def test_an_encoder_decoder_is_planned(tmp_path, capsys):
    rows, text = plan(tmp_path, capsys, "--model", config(tmp_path, T5), "--systems", "zero3")
    assert "4 blocks (T5Block in decoder.block, encoder.block)" in text
    assert rows["zero3"]["peak_bytes_per_rank"] > rows["zero3"]["model_state_bytes_per_rank"] > 0


def test_fsdp2_on_fused_experts_warns_and_names_the_fix(capsys):
    """transformers 5 fuses Mixtral's experts into 3-D parameters of one row an expert: past as
    many ranks FSDP2's dim-0 sharding stops sharding them."""
    from zerolab.plan import check, warnings_for

    mixtral = str(__import__("pathlib").Path(__file__).parents[2] / "benchmarks" / "configs"
                  / "tiny-mixtral.json")
    (w,) = warnings_for(check(mixtral, 16, False, False, 16), ["zero3", "fsdp2"], 16)
    assert "fewer rows than the 16 ranks" in w and "shard_placement_fn" in w and "flat" in w
    assert warnings_for(check(mixtral, 4, False, False, 16), ["fsdp2"], 4) == []
    assert warnings_for(check(mixtral, 16, False, False, 16), ["zero3"], 16) == []


def exits() -> None:
    sys.exit(0)


def test_hostile_input_gets_one_line(tmp_path, capsys):
    deep = config(tmp_path, LLAMA | {"num_hidden_layers": 1_000_000}, "deep.json")
    err = error_of(capsys, "--model", deep)  # refused before a layer is built
    assert "num_hidden_layers = 1,000,000" in err and f"{MAX_LAYERS:,} layers" in err
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested deeper" in error_of(capsys, "--model", str(nested))
    err = error_of(capsys, "--model", f"{__name__}:exits")
    assert "called sys.exit(0)" in err
    with pytest.raises(SystemExit):
        main(["plan", "--world-size", "4", "--model", "x:y", "--efficiency", "0"])
    assert "--efficiency must be a positive number" in capsys.readouterr().err


def test_help_gives_every_flags_default(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    import argparse

    from zerolab.plan import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in action.help or "required" in action.help, action.dest
    assert "(default: dgx-h100)" in text and "(default: 2048)" in text
