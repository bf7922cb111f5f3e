"""notes/19-plan.md quotes the plan's output; these rerun the commands and hold the quotes to
them, character for character (the plan's figures do not depend on the machine; only its own
simulation seconds do, and the notes quote none of those from these commands). Each run
simulates Llama-3-8B: the full matrix (ZERO_FULL=1)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
NOTES = open(os.path.join(ROOT, "notes", "19-plan.md")).read()


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


@pytest.mark.full
def test_the_first_example_is_what_the_command_prints():
    pytest.importorskip("transformers")
    from zerolab.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--model", os.path.join(ROOT, "benchmarks", "configs", "llama-3-8b.json"),
              "--world-size", "64", "--cluster", "dgx-h100", "--mixed-precision", "--batch", "1",
              "--seq", "8192", "--explain"])
    block = NOTES.split("## Reading the table")[1].split("```")[1]
    assert _rows(block) == _rows(out.getvalue())[:len(_rows(block))]
    # the same command's --explain table, quoted where the notes size each effect
    causes = NOTES.split("## Time on the GPU")[1].split("```")[1]
    assert _rows(causes) == _rows(out.getvalue().split("The step by cause")[1])
    quoted = re.search(r"Compute a step .*?s\.", block).group(0)
    assert quoted in out.getvalue()


@pytest.mark.full
def test_the_anchor_tables_are_what_plan_anchors_prints(tmp_path):
    """Both ends of the GPU's stated peak: the preset's 989 TFLOPS and --tflops 835."""
    pytest.importorskip("torchtitan")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plan_anchors

    section = NOTES.split("**Beside torchtitan's published runs.**")[1]
    quoted = [t for t in section.split("\n\n") if t.startswith("| GPUs")]
    for extra, table in ((["--tflops", "835"], quoted[1]), ([], quoted[0])):
        with contextlib.redirect_stdout(io.StringIO()):
            plan_anchors.main([*extra, "--out", str(tmp_path / "a.md")])
        assert _rows(table) == _rows((tmp_path / "a.md").read_text()), extra
