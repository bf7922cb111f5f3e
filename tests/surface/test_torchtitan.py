"""torchtitan trains on ``zero.fully_shard`` unchanged: bitwise FSDP2, 3 steps, 2 ranks.

Each case runs ``benchmarks/torchtitan_example.py``'s comparison: torchtitan's own debug
flavour, parallelize function, chunked loss, optimizer container, ``clip_grad_norm_`` and
``Trainer.train_step``, once on FSDP2 and once with ``fully_shard`` bound to
``zero.fully_shard``; losses, gradient norms, parameters and buffers must be equal at every
step (``torch.equal``), and zero must reduce-scatter as often as FSDP2 (the chunked loss keeps
``lm_head`` unsynced across its chunks only when ``lm_head`` is an ``FSDPModule``). The
checkpoint case saves with torchtitan's ``CheckpointManager`` after step 2 and resumes a
fresh model (initialised from another seed) to step 3.

Skipped when torchtitan is not installed (``pip install -c .ci/constraints.txt -e
".[titan]"``). The suite runs a sample; ``ZERO_TITAN_MATRIX=1 pytest tests/surface/test_torchtitan.py``
runs every stage with every precision, AC mode and model, reshard-never with gradient
accumulation and tied embeddings, CPU offload (against FSDP2 without it: FSDP2's pins memory,
which needs an accelerator), and checkpoints crossing between FSDP2 and zero; and tensor
parallel 2 x FSDP 2 on 4 ranks (torchtitan's own TP plan, 2-D DTensor parameters), every stage
and precision, and its checkpoints both ways (about 15 s a run: not in the default suite).
"""

import os
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: "
                    'pip install -c .ci/constraints.txt -e ".[titan]"')
pytest.importorskip("triton", reason="torchtitan imports triton (its MoE token dispatcher)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import torchtitan_example as titan  # noqa: E402
from conftest import FULL
from harness import run_ranks  # noqa: E402

Case = titan.Case


@pytest.fixture(scope="module", autouse=True)
def torchtitan_imported():
    """Import torchtitan once here (seconds), not in every forked rank."""
    import torchtitan.models.deepseek_v3.config_registry  # noqa: F401
    import torchtitan.models.llama3.config_registry  # noqa: F401
    import torchtitan.trainer  # noqa: F401


# Each entry: one FSDP2 run, then zero at each stage listed.
CASES = [[Case(stage=1), Case(stage=2), Case(stage=3)]]  # the MoE model: in the full matrix
MATRIX = [[Case(m, s, p, a) for s in (1, 2, 3)] for m in ("llama3", "deepseek_v3")
          for p in ("fp32", "bf16") for a in ("none", "full", "selective")] + [
    [Case(stage=s, reshard="never", accumulate=2, tied=True) for s in (1, 2, 3)],
    [Case(stage=s, precision="bf16", offload=True) for s in (1, 2, 3)]]
BIG = bool(os.environ.get("ZERO_TITAN_MATRIX")) or FULL  # every case: minutes


def _name(cases):
    c = cases[0]
    return f"{c.model}-{c.precision}-{c.ac}-stages" + "".join(str(c.stage) for c in cases) + (
        "-tied-accumulate-nevershard" if c.tied else "") + ("-offload" if c.offload else "") + (
        f"-tp{c.tp}" if c.tp > 1 else "")


@pytest.mark.parametrize("cases", MATRIX if BIG else CASES, ids=_name)
def test_torchtitan_on_zero_is_bitwise_fsdp2(cases):
    tables = run_ranks(titan.work, 2, [("compare", cases)], timeout=60 + 60 * len(cases))[0][0]
    for case, rows in zip(cases, tables):
        assert titan.bitwise(rows), titan.table(case, rows)
        assert all(r["rs_ours"] == r["rs_ref"] for r in rows), titan.table(case, rows)


RESUMES = [(Case(stage=3), "zero", "zero")]
RESUME_MATRIX = [(Case(stage=s), a, b) for s in (1, 2, 3)
                 for a, b in (("zero", "zero"), ("fsdp2", "zero"), ("zero", "fsdp2"))]


@pytest.mark.parametrize("case,saver,loader", RESUME_MATRIX if BIG else RESUMES,
                         ids=lambda x: f"stage{x.stage}" if isinstance(x, Case) else x)
def test_checkpoint_manager_resumes_bitwise(case, saver, loader, tmp_path):
    r = run_ranks(titan.work, 2, [("resume", case, str(tmp_path), saver, loader)],
                  timeout=120)[0][0]
    assert titan.resumed_bitwise(r), titan.resume_table(case, [r])


# Tensor parallel 2 x FSDP 2 on 4 ranks: each entry one FSDP2 run, then zero at each stage.
TP_MATRIX = [[Case(stage=s, precision=p, tp=2) for s in (1, 2, 3)] for p in ("fp32", "bf16")]


@pytest.mark.skipif(not BIG, reason="4 ranks, ~15 s a run: ZERO_TITAN_MATRIX=1 or ZERO_FULL=1")
@pytest.mark.parametrize("cases", TP_MATRIX, ids=_name)
def test_torchtitan_tensor_parallel_on_zero_is_bitwise_fsdp2(cases):
    tables = run_ranks(titan.work, 4, [("compare", cases)], timeout=120 + 60 * len(cases))[0][0]
    for case, rows in zip(cases, tables):
        assert titan.bitwise(rows), titan.table(case, rows)
        assert all(r["rs_ours"] == r["rs_ref"] for r in rows), titan.table(case, rows)


@pytest.mark.skipif(not BIG, reason="4 ranks, ~30 s: ZERO_TITAN_MATRIX=1 or ZERO_FULL=1")
def test_checkpoint_manager_resumes_tensor_parallel_bitwise_both_ways(tmp_path):
    case = Case(stage=3, tp=2)
    jobs = [("resume", case, str(tmp_path / f"{a}-{b}"), a, b)
            for a, b in (("zero", "zero"), ("fsdp2", "zero"), ("zero", "fsdp2"))]
    rows = run_ranks(titan.work, 4, jobs, timeout=300)[0]
    assert all(titan.resumed_bitwise(r) for r in rows), titan.resume_table(case, rows)
