"""When zero waits, read from the profiler as FSDP2's own trace reads: every hook, collective
and wait is a range named as FSDP2 names its own (``zero::post_backward (blocks.0)`` beside
``FSDP::post_backward (blocks.0)``).

- a unit's reduce-scatter runs under the next unit's backward: its wait is inside that
  unit's post-backward, never in a pre-backward (FSDP2's ``post_backward``);
- ``reduce_scatter_depth=2`` lets two fly: the wait moves one unit later;
- backward prefetch follows the order forwards ended: the root's backward gathers the last
  block;
- the user's explicit prefetch lists work whatever schedule is plugged in; a schedule's
  answer is issued in an order every rank shares, and a wrong answer is named.
"""

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import zero
from conftest import sample
from harness import run_ranks
from zerolab.models import GPT, GPTConfig


def _gpt(stage=3, layers=2, **root_kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, dim=32, vocab=64, seq=8))
    for unit in model.units():
        zero.shard(unit, stage=stage, **(root_kw if unit is model else {}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, rank, s=0):
    x, y = model.batch(2, torch.Generator().manual_seed(10 * s + rank))
    loss = model.loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _ranges(rank, n, stage, kw):
    """One profiled step after a warm-up: [(name, start, end)] of zero's ranges."""
    os.environ["ZERO_CHECK"] = "0"
    model, opt = _gpt(stage, **kw)
    _step(model, opt, rank)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt, rank, 1)
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.name.startswith("zero::")]


def _inside(ranges, inner: str, outer_prefix: str) -> list[str]:
    """The ranges starting with ``outer_prefix`` that contain the range ``inner``."""
    (start, end), = [(s, e) for name, s, e in ranges if name == inner]
    return [name for name, s, e in ranges if name.startswith(outer_prefix) and s <= start
            and end <= e]


@pytest.mark.parametrize("stage", sample([3], [2, 3]))
def test_a_reduce_scatter_runs_under_the_next_units_backward(stage):
    ranges = run_ranks(_ranges, 2, stage, {})[0]
    names = {name for name, *_ in ranges}
    for label in ("pre_forward", "post_forward", "pre_backward", "post_backward",
                  "post_backward_reduce", "post_backward_rs_wait"):
        assert f"zero::{label} (blocks.0)" in names, label
    assert "zero::root_post_backward_callback" in names
    # blocks.1's reduction is ended by blocks.0's post-backward (its gradient complete),
    # blocks.0's by the root's: no pre-backward waits for a reduction any more
    assert _inside(ranges, "zero::post_backward_rs_wait (blocks.1)", "zero::post_backward (") \
        == ["zero::post_backward (blocks.0)"]
    assert _inside(ranges, "zero::post_backward_rs_wait (blocks.0)", "zero::post_backward (") \
        == ["zero::post_backward (root)"]
    assert not [n for n in names if n.startswith("zero::pre_backward") and _inside(
        ranges, n, "zero::post_backward_rs_wait")]
    if stage == 3:  # the root's backward (loss, head) gathers the last block, FSDP2's order
        assert _inside(ranges, "zero::backward_prefetch for blocks.1", "zero::pre_backward") \
            == ["zero::pre_backward (root)"]
        assert "zero::all_gather (blocks.1)" in names


def test_a_deeper_reduce_scatter_depth_waits_one_unit_later():
    ranges = run_ranks(_ranges, 2, 2, {"reduce_scatter_depth": 2})[0]
    assert _inside(ranges, "zero::post_backward_rs_wait (blocks.1)", "zero::post_backward (") \
        == ["zero::post_backward (root)"]


def test_reduce_scatter_depth_is_checked():
    with pytest.raises(Exception, match="reduce_scatter_depth=0: how many reduce-scatters"):
        run_ranks(_gpt_with, 2, {"reduce_scatter_depth": 0})


def _gpt_with(rank, n, kw):
    _gpt(**kw)


class _Nothing:
    """A schedule of one's own that prefetches nothing."""

    def forward_prefetch(self, unit, order):
        return []

    def backward_prefetch(self, unit, order):
        return []


class _Shuffled:
    """Prefetches the same units on every rank, listed in another order on each."""

    def forward_prefetch(self, unit, order):
        if unit is not order.units[0]:
            return []
        blocks = list(order.units[1:])
        return blocks[::-1] if torch.distributed.get_rank() else blocks

    def backward_prefetch(self, unit, order):
        return []


class _Answers:
    """Answers with what it was made with: modules, None, or something else."""

    def __init__(self, answer):
        self.answer = answer

    def forward_prefetch(self, unit, order):
        return self.answer(unit, order)

    def backward_prefetch(self, unit, order):
        return []


def _prefetches(rank, n, case):
    os.environ["ZERO_CHECK"] = "0"  # (the default: check mode would catch a pairing)
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8))
    schedule = {"nothing": _Nothing(), "explicit": _Nothing(), "shuffled": _Shuffled(),
                "modules": _Answers(lambda u, o: [model.blocks[0]] if u is o.units[0] else None),
                "none": _Answers(lambda u, o: None),
                "wrong": _Answers(lambda u, o: ["blocks.0"]), "default": None}[case]
    for unit in model.units():
        zero.shard(unit, stage=3, schedule=schedule if unit is model else None)
    if case == "explicit":
        zero.set_modules_to_forward_prefetch(model, [model.blocks[0]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, prefetched = [], []
    with zero.Ledger(on_record=lambda r: prefetched.append(r.unit) if r.op == "all_gather"
                     and r.phase == "forward" and "forward_started" in _stack() else None):
        for s in range(3):
            losses.append(_step(model, opt, rank, s))
    return torch.stack(losses), sorted(set(prefetched))


def _stack() -> str:
    import traceback
    return " ".join(f.name for f in traceback.extract_stack())


def test_explicit_prefetch_lists_are_honoured_whatever_the_schedule():
    """FSDP2's setters are the user's: a schedule of one's own does not silence them."""
    nothing = run_ranks(_prefetches, 2, "nothing")[0][1]
    explicit = run_ranks(_prefetches, 2, "explicit")[0][1]
    assert nothing == [] and explicit == ["blocks.0"]


def test_a_schedule_answering_in_another_order_on_each_rank_trains_right():
    default = run_ranks(_prefetches, 2, "default")
    shuffled = run_ranks(_prefetches, 2, "shuffled")
    assert shuffled[0][1] == ["blocks.0", "blocks.1"]
    for (theirs, _), (ours, _) in zip(default, shuffled):
        assert torch.equal(theirs, ours)


def test_a_schedule_may_answer_with_modules_or_none_and_is_named_otherwise():
    assert run_ranks(_prefetches, 2, "modules")[0][1] == ["blocks.0"]
    assert run_ranks(_prefetches, 2, "none")[0][1] == []
    with pytest.raises(Exception, match=r"_Answers.forward_prefetch returned str 'blocks.0': "
                                        "it must return units of this model"):
        run_ranks(_prefetches, 2, "wrong")
