"""``python -m zerolab trace``: the narrated step prints every collective of the step, and the
outputs the chapters quote (notes/figures/trace_stage{1,2,3}.txt) are what it prints today.

The first column of a trace is the time in ms, which differs from run to run; everything
else (the order of events, the bytes sent and held) is the program's and must match the
committed text character for character.
"""

import os
import re

import pytest

import zerolab.__main__
from zerolab.trace import narrate, trace

FIGURES = os.path.join(os.path.dirname(__file__), "..", "..", "notes", "figures")
TIME = re.compile(r"^ *\d+\.\d\d  ")  # the ms column


def without_times(lines):
    return [TIME.sub("  ", line) for line in lines]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_trace_prints_every_gather_and_reduce_scatter_and_matches_its_figure(stage, monkeypatch):
    monkeypatch.setenv("ZERO_CHECK", "0")  # as a reader runs it: no agreement per collective
    t = trace(stage)
    lines = narrate(t)
    printed = [(m.group(1), m.group(2), int(m.group(3))) for m in
               (re.match(r" *\d+\.\d\d  (\S+) +(all-gather|reduce-scatter) issued, sends (\d+) B", s)
                for s in lines) if m]
    ledger = [(r.unit, r.op.replace("_", "-"), r.sent_bytes) for r in t.records
              if r.op in ("all_gather", "reduce_scatter")]
    assert printed == ledger and len(ledger) == {1: 6, 2: 6, 3: 8}[stage]
    # the summary is the rows added up: each kind's count and the bytes all its rows send
    text = "\n".join(lines)
    for op in ("all-gather", "reduce-scatter"):
        rows = [b for _, o, b in printed if o == op]
        assert f"{len(rows)} {op}s {sum(rows)} B" in text, op
    total = sum(b for *_, b in printed)
    ring = 4 * t.psi * (t.world_size - 1) / t.world_size
    assert f"all-gathers + reduce-scatters: {total} B = {total / ring:.3f} R" in text
    # every row after which this rank holds something says how much, "done" rows included
    done = [s for s in lines if re.search(r"(all-gather|reduce-scatter|all-reduce) done", s)]
    assert done and all(re.search(r"\d+ +\d+  \S", s) for s in done)
    if stage == 3:  # each unit frees its full parameters in backward, in a row of its own
        frees = re.findall(r"(\S+) +post_backward: frees its full parameters", text)
        assert sorted(frees) == sorted(name for name, _ in t.units)
    if stage > 1:  # and each full gradient, once reduced, where it happens
        freed = re.findall(r"(\S+) +full gradient freed, its shard kept", text)
        assert sorted(freed) == sorted(name for name, _ in t.units)
    assert sum(r.op == "agree" for r in t.records) == 1
    path = os.path.join(FIGURES, f"trace_stage{stage}.txt")
    committed = open(path).read().splitlines()
    assert without_times(committed) == without_times(lines), (
        f"{path} is stale: python -m zerolab trace --stage {stage} > {path}")


def test_the_command_line(capsys, monkeypatch):
    monkeypatch.setenv("ZERO_CHECK", "0")
    with pytest.raises(SystemExit) as exit:
        zerolab.__main__.main(["trace", "--dim", "30"])
    assert exit.value.code == 2 and "multiple of 4" in capsys.readouterr().err
    zerolab.__main__.main(["trace", "--stage", "2", "--layers", "1", "--world-size", "3"])
    out = capsys.readouterr().out
    assert "ZeRO-2: one training step of a GPT (1 blocks" in out
    assert "on 3 gloo ranks" in out and out.count("reduce-scatter issued") == 2
