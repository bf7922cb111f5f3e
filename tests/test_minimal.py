"""zero/minimal.py, the three stages in one file: it must train bit for bit like DDP and like the
full package, and issue exactly the collectives its stage says, in the order it says.

Run it first: ``pytest tests/test_minimal.py`` (a few seconds, 2 or 3 forked CPU ranks).
"""

import copy
import os

import pytest
import torch
from compare import first_difference
from harness import run_ranks

from zero import comm, minimal
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System, make_optimizer

STEPS = 3


def full_parameters(model, units) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by its original name (gathered from the units' shards)."""
    names = {m: n for n, m in model.named_modules()}
    out = {}
    for u in units:
        full = u.shard.new_empty(u.layout.padded_numel)
        comm.all_gather(full, u.shard.detach())  # (S,) per rank -> (N*S,)
        views = u.layout.views(full)
        for mod, attr, i in u.uses:
            out[f"{names[mod]}.{attr}".lstrip(".")] = views[i].clone()
    return out


def train(rank, n, stages, refs):
    """Train minimal.py at each stage beside the reference systems; per stage, return what
    differed after each step, minimal.py's ledger of each step, and its units' sizes."""
    results = {}
    for stage in stages:
        torch.manual_seed(0)
        base = GPT(GPTConfig(layers=3))
        systems = [System(kind.format(stage=stage), base) for kind in refs]
        model = copy.deepcopy(base)
        units = minimal.shard(model, model.blocks, stage)
        opt = make_optimizer("adamw", list(model.named_parameters()))  # what System uses
        diffs, ledgers = [], []
        for s in range(STEPS):
            x, y = base.batch(4, torch.Generator().manual_seed(1000 * s + 10 * rank))  # System's
            with comm.Ledger() as ledger:
                loss = base.loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            ledgers.append([(r.op, r.unit, r.phase, r.buffer_bytes) for r in ledger.records
                            if r.op != "agree"])
            mine = full_parameters(model, units)
            for sys_ in systems:
                ref_loss = sys_.step(rank, s)[0][0]
                ref = sys_.full_params()
                if not torch.equal(ref_loss, loss.detach()):
                    diffs.append(f"step {s}: loss {loss.item()!r}, {sys_.kind} {ref_loss.item()!r}")
                if (d := first_difference(ref, {k: mine[k] for k in ref if k in mine})) is not None:
                    diffs.append(f"step {s}, vs {sys_.kind}: {d}")
        sizes = {u.name: u.layout.padded_numel * u.shard.element_size() for u in units}
        left = {u.name: u.full.untyped_storage().nbytes() for u in units}
        results[stage] = (diffs, ledgers, sizes, left)
    return results


@pytest.fixture(scope="module")
def at_world_size_2():
    return run_ranks(train, 2, (1, 2, 3), ("ddp", "zero{stage}"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bitwise_equal_to_ddp_and_the_full_package(at_world_size_2, stage):
    for rank, results in enumerate(at_world_size_2):
        diffs = results[stage][0]
        assert not diffs, f"rank {rank}, stage {stage}:\n" + "\n".join(diffs)


def test_bitwise_equal_to_the_full_package_at_world_size_3():
    """N = 3 pads every unit (a block has 12704 elements) and averages by 3, which DDP rounds
    differently: the package, with the same flat layout, must still agree bit for bit."""
    for rank, results in enumerate(run_ranks(train, 3, (1, 2, 3), ("zero{stage}",))):
        for stage, (diffs, *_) in results.items():
            assert not diffs, f"rank {rank}, stage {stage}:\n" + "\n".join(diffs)


def expected_schedule(stage: int, blocks: list[str]) -> list[tuple[str, str, str]]:
    """(op, unit, phase) in issue order: what each stage's docstring says it does."""
    forward = [("all_gather", u, "forward") for u in ["root", *blocks]]  # the root runs first
    if stage == 1:  # every full gradient waits for the end of backward
        return forward + [("reduce_scatter", u, "backward") for u in [*blocks, "root"]]
    regather = (lambda u: [("all_gather", u, "backward")]) if stage == 3 else (lambda u: [])
    backward = regather("root")  # the head is the first thing backward needs
    for u in reversed(blocks):  # each block's gradient is reduced as soon as it is complete
        backward += regather(u) + [("reduce_scatter", u, "backward")]
    return forward + backward + [("reduce_scatter", "root", "backward")]  # the embeddings: last


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collectives_per_step_are_the_stages(at_world_size_2, stage):
    """Stages 1/2: one all-gather and one reduce-scatter per unit and step, stage 1's all at
    the end of backward; stage 3: a second all-gather per unit, in backward, and afterwards
    no unit holds its full parameters."""
    for rank, results in enumerate(at_world_size_2):
        _, ledgers, sizes, left = results[stage]
        blocks = [u for u in sizes if u != "root"]
        for step, ledger in enumerate(ledgers):
            assert [r[:3] for r in ledger] == expected_schedule(stage, blocks), (rank, step)
            assert all(r[3] == sizes[r[1]] for r in ledger), "each moves its unit's flat buffer"
        kept = {u: sizes[u] if stage < 3 else 0 for u in sizes}
        assert left == kept, f"bytes of full parameters left after the step: {left}"


def test_minimal_stays_minimal():
    path = os.path.join(os.path.dirname(__file__), "..", "zero", "minimal.py")
    assert len(open(path).read().splitlines()) <= 150
