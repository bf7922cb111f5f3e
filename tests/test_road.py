"""notes/road/: five runnable steps from naive data parallel to ZeRO-3 with prefetching, each a
short edit of the step before. Every step must train bit for bit like torch's DDP, do what its
docstring says (seen in the ledger and the probes of notes/road/common.py), stay a short diff
from the step before, and run as a script.
"""

import difflib
import os
import re
import runpy
import sys

import pytest
from harness import run_ranks

ROAD = os.path.join(os.path.dirname(__file__), "..", "notes", "road")
sys.path.insert(0, ROAD)
import common  # noqa: E402  (notes/road/common.py)

STEPS = ["1_ddp", "2_zero1", "3_zero2", "4_zero3", "5_prefetch"]

# A step is one idea: its diff from the step before must fit on a screen. The largest step
# (prefetching: async gathers, a wait, the order of units) takes 34 changed lines,
# a third of them its docstring; 40 leaves room for a clearer comment, not a second idea.
MAX_CHANGED_LINES = 40

# What one step of each must show at N = 2 (AdamW's state: 8 bytes per parameter in DDP):
# bytes sent in Ψ, optimizer state and full parameters kept after the step (bytes per
# parameter), and, as a block starts its forward, the units holding full parameters and the
# later blocks already being gathered.
EXPECTED = {
    "1_ddp": dict(sent=2.0, optimizer=8.0, kept=4.0, held=5, ahead=0),
    "2_zero1": dict(sent=2.0, optimizer=4.0, kept=4.0, held=5, ahead=0),
    "3_zero2": dict(sent=2.0, optimizer=4.0, kept=4.0, held=5, ahead=0),
    "4_zero3": dict(sent=3.0, optimizer=4.0, kept=0.0, held=2, ahead=0),
    "5_prefetch": dict(sent=3.0, optimizer=4.0, kept=0.0, held=3, ahead=1),
}


def source(step: str) -> list[str]:
    return open(os.path.join(ROAD, f"{step}.py")).read().splitlines()


def changed_lines(a: list[str], b: list[str]) -> int:
    """What ``diff a b | grep -c '^[<>]'`` counts: lines removed plus lines added."""
    diff = difflib.unified_diff(a, b, n=0, lineterm="")
    return sum(line[:1] in "+-" and not line.startswith(("+++", "---")) for line in diff)


@pytest.fixture(scope="module")
def reports():
    shards = {step: runpy.run_path(os.path.join(ROAD, f"{step}.py"))["shard"] for step in STEPS}
    return run_ranks(common.train, 2, shards)


@pytest.mark.parametrize("step", STEPS)
def test_every_step_trains_like_ddp_bitwise(reports, step):
    for rank, per_rank in enumerate(reports):
        r = per_rank[step]
        assert not r["diffs"], f"rank {rank}: {r['diffs'][:3]}"
        assert r["losses"] == r["ddp_losses"], f"rank {rank}"


@pytest.mark.parametrize("step", STEPS)
def test_every_step_does_what_it_says(reports, step):
    r, want = reports[0][step], EXPECTED[step]
    psi = r["psi"] * 4 * (r["world_size"] - 1) / r["world_size"]  # the paper's Ψ, in bytes sent
    assert sum(x[3] for x in r["ledger"]) / psi == pytest.approx(want["sent"], abs=0.01)
    assert r["optimizer_bytes"] / r["psi"] == pytest.approx(want["optimizer"], abs=0.01)
    assert r["full_bytes"] / r["psi"] == pytest.approx(want["kept"], abs=0.01)
    assert max(p[0] for p in r["probes"]) == want["held"]
    assert max(p[1] for p in r["probes"]) == want["ahead"]
    reduced = [unit for op, unit, _, _ in r["ledger"] if op in ("reduce_scatter", "all_reduce")]
    blocks = [f"blocks.{k}" for k in range(common.BLOCKS)]
    if step in ("1_ddp", "2_zero1"):  # every gradient waits for the end of backward
        assert reduced == [*blocks, "root"]
    else:  # each as soon as it is complete: the last block's first
        assert reduced == [*reversed(blocks), "root"]


@pytest.mark.parametrize("before, after", list(zip(STEPS, STEPS[1:])))
def test_each_step_is_a_short_diff_of_the_one_before(before, after):
    changed = changed_lines(source(before), source(after))
    assert 0 < changed <= MAX_CHANGED_LINES, f"{before} -> {after}: {changed} lines changed"
    readme = open(os.path.join(ROAD, "README.md")).read()
    said = re.search(rf"`{before}.py` → `{after}.py` \|[^|\n]*\| *(\d+) *\|", readme)
    assert said and int(said.group(1)) == changed, "notes/road/README.md must say the measured size"


@pytest.mark.parametrize("step", STEPS)
def test_every_step_runs_as_a_script(step, capsys):
    with pytest.raises(SystemExit) as done:
        runpy.run_path(os.path.join(ROAD, f"{step}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "bitwise equal to torch DDP's after every step: yes" in out
