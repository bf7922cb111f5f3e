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

from zero.core.flat import FlatLayout
from zerolab.models import GPT, GPTConfig

ROAD = os.path.join(os.path.dirname(__file__), "..", "..", "notes", "road")
sys.path.insert(0, ROAD)
import common  # noqa: E402  (notes/road/common.py)

STEPS = ["1_ddp", "2_zero1", "3_zero2", "4_zero3", "5_prefetch"]

# A step is one idea: its diff from the step before must fit on a screen. The largest step
# (prefetching: async gathers, a wait, the order of units) takes 34 changed lines,
# a third of them its docstring; 40 leaves room for a clearer comment, not a second idea.
MAX_CHANGED_LINES = 40

# What one step of each must show at N = 2 (AdamW's state: 8 bytes per parameter in DDP):
# bytes sent in R (4 bytes x Ψ x (N-1)/N), optimizer state and full parameters kept after the
# step (bytes per parameter), and, as a block starts its forward, the units holding full
# parameters (the root counts) and the later blocks already being gathered.
EXPECTED = {
    "1_ddp": dict(sent=2.0, optimizer=8.0, kept=4.0, held=5, ahead=0),
    "2_zero1": dict(sent=2.0, optimizer=4.0, kept=4.0, held=5, ahead=0),
    "3_zero2": dict(sent=2.0, optimizer=4.0, kept=4.0, held=5, ahead=0),
    "4_zero3": dict(sent=3.0, optimizer=4.0, kept=0.0, held=2, ahead=0),
    "5_prefetch": dict(sent=3.0, optimizer=4.0, kept=0.0, held=3, ahead=1),
}


def memory_formulas(step: str, block: int, root: int, n: int) -> dict[str, float]:
    """What the road's memory lines must read, in bytes per parameter, from the stages'
    formulas applied unit by unit (fp32, 4 bytes an element; units padded to a multiple of n):
    the peak parameter and gradient bytes during backward, and the gradient bytes after it."""
    units = [block] * common.BLOCKS + [root]  # elements, forward order
    psi = sum(units)
    full = lambda k: 4 * k / psi  # noqa: E731  (a unit's full copy)
    shard = lambda k: 4 * k / n / psi  # noqa: E731  (this rank's slice of it)
    everything = sum(full(k) for k in units)
    if step == "1_ddp":  # all of it, always
        return dict(params=everything, grads=everything, after=everything)
    # ZeRO-1 keeps every full gradient to the end, then reduces in unit order: the peak is all
    # of them plus the first unit's new shard. ZeRO-2 and -3 reduce each unit as backward
    # completes it (the last block first): its full gradient, and the shards made so far.
    done, grads = 0.0, 0.0
    for k in reversed(units[:-1]):
        done += shard(k)
        grads = max(grads, full(k) + done)
    grads = max(grads, full(root) + done + shard(root))
    if step == "2_zero1":
        grads = everything + shard(units[0])
    params = everything + sum(shard(k) for k in units)  # full copies, and the shards apart
    if step in ("4_zero3", "5_prefetch"):  # shards; the root and one block whole, two prefetching
        whole = 1 + (step == "5_prefetch")  # blocks held whole at once
        params = sum(shard(k) for k in units) + full(root) + full(block) * whole
    return dict(params=params, grads=grads, after=sum(shard(k) for k in units))


def source(step: str) -> list[str]:
    return open(os.path.join(ROAD, f"{step}.py")).read().splitlines()


def changed_lines(a: list[str], b: list[str]) -> int:
    """What ``diff a b | grep -c '^[<>]'`` counts: lines removed plus lines added."""
    diff = difflib.unified_diff(a, b, n=0, lineterm="")
    return sum(line[:1] in "+-" and not line.startswith(("+++", "---")) for line in diff)


@pytest.fixture(scope="module")
def reports():
    shards = {step: runpy.run_path(os.path.join(ROAD, f"{step}.py"))["shard"] for step in STEPS}
    with pytest.MonkeyPatch.context() as env:  # as a reader runs them: without check mode,
        env.setenv("ZERO_CHECK", "0")  # whose agreements would double the collectives' count
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
    block, root = (FlatLayout([p.shape for p in m.parameters()], 2).padded_numel
                   for m in (GPT(GPTConfig(layers=1)).blocks[0], GPT(GPTConfig(layers=0))))
    said = memory_formulas(step, block, root, r["world_size"])
    measured = dict(params=r["peak"]["params"], grads=r["peak"]["grads"], after=r["grad_bytes"])
    assert {k: round(v / r["psi"], 4) for k, v in measured.items()} == pytest.approx(said, abs=1e-4)
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


def test_the_memory_lines_tell_the_stages_apart(reports):
    """What the README promises a reader will see: ZeRO-1 cuts the optimizer state, ZeRO-2 the
    gradients held during backward (one full gradient at a time), ZeRO-3 the parameters."""
    lines = {step: [s for s in common.report(step, reports[0][step]).splitlines()
                    if s.startswith("  during backward") or s.startswith("  after backward")]
             for step in STEPS}
    assert len({tuple(v) for k, v in lines.items() if k != "5_prefetch"}) == 4, lines
    peak = {step: reports[0][step]["peak"] for step in STEPS}
    assert peak["3_zero2"]["grads"] < peak["2_zero1"]["grads"] / 1.5
    assert peak["3_zero2"]["params"] == peak["2_zero1"]["params"] > 1.5 * peak["4_zero3"]["params"]


def test_a_step_runs_as_a_script(capsys, monkeypatch):
    """Each step ends with common.main; one run of it shows the path works (the others are
    the same call, and the fixture above trains all five)."""
    monkeypatch.setenv("ZERO_CHECK", "0")  # as a reader runs it
    with pytest.raises(SystemExit) as done:
        runpy.run_path(os.path.join(ROAD, "3_zero2.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "bitwise equal to torch DDP's after every step: yes" in out
    assert "during backward, at most: parameters 6.00, gradients 2.80" in out


def printed(report: str) -> dict[str, float]:
    """The memory figures a step prints, in bytes per parameter."""
    nums = lambda pattern: [float(x) for x in re.search(pattern, report).groups()]  # noqa: E731
    params, grads = nums(r"during backward, at most: parameters ([\d.]+), gradients ([\d.]+)")
    after, optimizer = nums(r"after backward: gradients ([\d.]+); after the step: optimizer state ([\d.]+)")
    return dict(params=params, grads=grads, after=after, optimizer=optimizer)


def test_the_road_page_quotes_what_the_steps_print(reports):
    """Every figure of the road page's memory table is the one its step prints; every other
    two-decimal figure on the page is printed by some step or is a unit's size the page says
    it is (the units' shares of Ψ, one block's full gradient, the four blocks' shards)."""
    readme = open(os.path.join(ROAD, "README.md")).read()
    shown = {step: printed(common.report(step, reports[0][step])) for step in STEPS}
    rows = re.findall(r"^\| (\d) [\w-]+ \| (.+) \|$", readme, re.M)
    assert [int(k) for k, _ in rows] == [1, 2, 3, 4, 5]
    for k, cells in rows:
        said = [float(re.match(r"([\d.]+)", c.strip()).group(1)) for c in cells.split(" | ")]
        step = STEPS[int(k) - 1]
        assert said == [shown[step][c] for c in ("params", "grads", "after", "optimizer")], step
    r = reports[0]["1_ddp"]
    block, root = (FlatLayout([p.shape for p in m.parameters()], 2).padded_numel
                   for m in (GPT(GPTConfig(layers=1)).blocks[0], GPT(GPTConfig(layers=0))))
    psi = r["psi"]
    sizes = {f"{block / psi:.3f}", f"{root / psi:.3f}", f"{4 * block / psi:.2f}",
             f"{common.BLOCKS * 4 * block / 2 / psi:.2f}"}  # shares; a full gradient; 4 shards
    prints = {f"{v:.2f}" for s in shown.values() for v in s.values()}
    figures = set(re.findall(r"(?<![\d.])\d\.\d{2,3}(?![\d])", readme))
    assert figures - prints - sizes == set(), figures - prints - sizes
    assert sizes <= figures  # (the page gives each size it uses)


def test_the_road_says_it_trains_in_fp32_and_what_a_parameter_costs(reports):
    """The start page teaches bf16 with Adam (2 + 2 + 12 bytes); the road, before its first
    memory figure, says it trains in fp32 and what a parameter costs there, as DDP prints it."""
    readme = " ".join(open(os.path.join(ROAD, "README.md")).read().split())
    said = readme.index("The road trains in fp32")
    assert said < readme.index("| step | parameters, peak in backward")
    assert "4 + 4 + 8 = 16 bytes in DDP where bf16 with Adam took 2 + 2 + 12" in readme
    ddp = printed(common.report("1_ddp", reports[0]["1_ddp"]))
    assert (ddp["params"], ddp["after"], ddp["optimizer"]) == (4.0, 4.0, 8.0)
