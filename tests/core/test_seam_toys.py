"""Each seam of zero/api.py proven by a toy written from that file alone (tests/core/toys/):
a comm policy, an offload policy, a schedule, a backend and a layout, none subclassing
anything of zero's, none needing an edit under zero/. Each trains as the seam promises,
checked against DDP (or zero's own default) bit for bit at world size 2.
"""

import ast
import copy
import os

import pytest
import torch

import zero
from harness import run_ranks
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

TOYS = os.path.join(os.path.dirname(__file__), "toys")
STEPS = 3


def _base():
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=3, dim=16, vocab=32, seq=8))


def _zero(base, stage, root_kw=None, **kw):
    """``base`` copied and sharded unit by unit (``kw`` to every unit, ``root_kw`` to the root
    only), with its AdamW."""
    model = copy.deepcopy(base)
    for unit in model.units():
        zero.shard(unit, stage=stage, **kw, **((root_kw or {}) if unit is model else {}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, base, rank, after_step=None):
    for s in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * s + 10 * rank)
        x, y = base.batch(4, gen)
        base.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if after_step:
            after_step(s)
    return zero.full_state_dict(model)


def _ddp(base, rank):
    ddp = System("ddp", base)
    for s in range(STEPS):
        ddp.step(rank, s)
    return ddp.full_params()


def _equal(ours, ref):
    return [n for n in ref if not torch.equal(ours[n], ref[n])]


# ---- written from zero/api.py alone -----------------------------------------------------------


@pytest.mark.parametrize("toy", sorted(f for f in os.listdir(TOYS) if f.endswith(".py")))
def test_each_toy_is_written_from_api_alone(toy):
    """Under ~80 lines, importing nothing of zero but ``zero.api``, subclassing nothing."""
    source = open(os.path.join(TOYS, toy)).read()
    assert len(source.splitlines()) <= 80
    tree = ast.parse(source)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert all(m == "zero.api" or not m.startswith("zero") for m in imported), imported
    assert all(not c.bases for c in ast.walk(tree) if isinstance(c, ast.ClassDef))


# ---- a comm policy: stages 1 and 2 with one all-reduce per unit ---------------------------------


def _all_reduce_comm(rank, n, stage):
    from toys.comm import AllReduceComm

    base = _base()
    model, opt = _zero(base, stage, comm_policy=AllReduceComm())
    with zero.Ledger() as ledger:
        ours = _train(model, opt, base, rank)
    backward = [r.op for r in ledger.records if r.phase == "backward"]
    return _equal(ours, _ddp(base, rank)), backward


@pytest.mark.parametrize("stage", [1, 2])
def test_a_comm_policy_reduces_by_all_reduce_bitwise_like_ddp(stage):
    for differ, backward in run_ranks(_all_reduce_comm, 2, stage):
        assert differ == []
        units = 4  # three blocks and the root, each once a step; plus the root's used flags
        assert backward.count("all_reduce") == STEPS * (units + 1)
        assert "reduce_scatter" not in backward


# ---- an offload policy: the optimizer state on the host ----------------------------------------


def _host_state(rank, n):
    from toys.offload import HostOptimizerState

    base = _base()
    policy = HostOptimizerState()
    model, opt = _zero(base, 2, offload_policy=policy)
    kept = []

    def check(step):  # between steps the optimizer's state is what the policy keeps
        kept.append(all(opt.state[p][k] is policy.held[id(p)][k]
                        for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")))

    ours = _train(model, opt, base, rank, check)
    plain = _train(*_zero(base, 2), base, rank)
    return _equal(ours, plain), kept, _equal(ours, _ddp(base, rank))


def test_an_offload_policy_keeps_the_state_on_the_host_and_trains_the_same():
    for differ, kept, from_ddp in run_ranks(_host_state, 2):
        assert differ == [] and from_ddp == []
        assert kept == [True] * STEPS


# ---- a schedule: FSDP2's explicit prefetch lists -------------------------------------------------


def _explicit(rank, n):
    from toys.schedule import ExplicitPrefetch

    base = _base()
    model = copy.deepcopy(base)  # (the lists name the copy's modules: built after the copy)
    blocks = list(model.blocks)
    schedule = ExplicitPrefetch(
        forward={b: blocks[i + 1 : i + 3] for i, b in enumerate(blocks)},
        backward={b: blocks[max(0, i - 2) : i][::-1] for i, b in enumerate(blocks)})
    for unit in model.units():
        zero.shard(unit, stage=3, **({"schedule": schedule} if unit is model else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    events = []
    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: events.append(f"forward {i}"),
                                    prepend=True)  # (before zero's, which gathers)
    record = lambda r: events.append(f"gather {r.unit}") if (  # noqa: E731
        r.op == "all_gather" and r.phase == "forward") else None
    with zero.Ledger(on_record=record):
        ours = _train(model, opt, base, rank)
    last = events[len(events) - events[::-1].index("forward 0") - 1:]  # the last step's
    ahead = last[: last.index("forward 1")]
    return _equal(ours, _ddp(base, rank)), ahead


def test_a_schedule_passed_in_prefetches_as_its_lists_say():
    for differ, ahead in run_ranks(_explicit, 2):
        assert differ == []
        # from block 0's forward on, blocks 1 and 2 are gathered (zero's own: only block 1)
        assert ahead == ["forward 0", "gather blocks.0", "gather blocks.1", "gather blocks.2"]


# ---- a backend: every collective of the model through it ----------------------------------------


def _counted(rank, n):
    from toys.backend import CountingBackend

    base = _base()
    backend = CountingBackend()
    model, opt = _zero(base, 3, root_kw={"backend": backend})  # the root's only
    backend.counts.clear()  # (the root's call agreed through it already)
    with zero.Ledger() as ledger:
        _train(model, opt, base, rank)
    return sum(backend.counts.values()), len(ledger.records), dict(backend.counts)


def test_a_backend_given_to_the_root_carries_every_collective_of_the_model():
    for through, recorded, counts in run_ranks(_counted, 2):
        assert through == recorded > 0, counts  # every one the ledger saw (agreements too)
        assert counts["all_gather"] and counts["reduce_scatter"], counts


# ---- a layout: the flat one, reversed -----------------------------------------------------------


def _reversed(rank, n):
    from toys.layout import ReversedFlat

    base = _base()
    model, opt = _zero(base, 3, layout=ReversedFlat)
    return _equal(_train(model, opt, base, rank), _ddp(base, rank))


def test_a_layout_written_from_api_trains_bitwise_like_ddp():
    assert run_ranks(_reversed, 2) == [[], []]
