"""FSDP2's control surface (zero/surface/controls.py): each control does what it says, measured by the
ledger or the unsharded storage, and training stays bitwise equal to FSDP2 (or DDP) doing
the same, at world size 2."""

import pytest
import torch

import zero
from compare import ZERO, System, batch_of, compare, first_difference
from harness import run_ranks
from zerolab.models import GPT


def _gathers(ledger, phase=None):
    return [r.unit for r in ledger.records if r.op == "all_gather" and (phase is None or r.phase == phase)]


def _model(stage=3):
    torch.manual_seed(0)
    model = GPT()
    for unit in model.units():
        zero.shard(unit, stage=stage)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _unshard_pins(rank, n):
    model, opt = _model()
    x, y = model.batch(2, torch.Generator().manual_seed(rank))
    with torch.no_grad():
        reference = model(x)
    zero.unshard(model.blocks[0])
    handle = zero.unshard(model.blocks[1], async_op=True)
    handle.wait()
    with zero.Ledger() as ledger, torch.no_grad():
        outs = [model(x) for _ in range(3)]  # an eval loop: blocks 0 and 1 stay gathered
    pinned = _gathers(ledger)
    model.loss(model(x), y).backward()  # training works on the pinned units too
    opt.step()
    opt.zero_grad()
    with zero.Ledger() as ledger, torch.no_grad():
        model(x)  # the step changed the shards: the pinned units gather them again, once
    after_step = _gathers(ledger)
    zero.reshard(model.blocks[0])
    zero.reshard(model.blocks[1])
    freed = [u.unsharded.untyped_storage().nbytes() for u in zero.units_of(model)[1:3]]
    return (all(torch.equal(o, reference) for o in outs), pinned, after_step, freed)


def test_unshard_keeps_a_unit_gathered_until_reshard():
    same, pinned, after_step, freed = run_ranks(_unshard_pins, 2)[0]
    assert same
    # (the root is freed after each no_grad forward and gathered again: it is not pinned)
    assert "blocks.0" not in pinned and "blocks.1" not in pinned and pinned.count("root") == 3
    assert after_step.count("blocks.0") == 1 and after_step.count("blocks.1") == 1
    assert freed == [0, 0]


def _prefetch(sys_, rank, s):
    model = sys_.model
    if s == 0 and sys_.kind.startswith("zero"):
        zero.set_modules_to_forward_prefetch(model.blocks[0], [model.blocks[1]])
        zero.set_modules_to_backward_prefetch(model.blocks[1], [model.blocks[0]])
    elif s == 0:
        model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
        model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    sys_.step(rank, s)


def _prefetch_order(rank, n, explicit):
    model, opt = _model()
    if explicit:
        zero.set_modules_to_forward_prefetch(model.blocks[0], [model.blocks[1]])
    with zero.Ledger() as ledger:
        seen = []  # the gathers issued when blocks.0 starts computing (after zero's hook)
        model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(_gathers(ledger)))
        x, y = model.batch(2, torch.Generator().manual_seed(rank))
        model.loss(model(x), y).backward()
    return seen[0]


def test_explicit_prefetch_lists_are_followed_and_train_like_fsdp2():
    # The first iteration has no recorded order to prefetch from: only the explicit list acts.
    assert run_ranks(_prefetch_order, 2, False)[0] == ["root", "blocks.0"]
    assert run_ranks(_prefetch_order, 2, True)[0] == ["root", "blocks.0", "blocks.1"]
    assert run_ranks(compare, 2, GPT, "fsdp2", ["zero3"], {"step": _prefetch}) == [[], []]


def _keep_last_block(sys_, rank, s):
    model = sys_.model
    if s == 0:
        if sys_.kind.startswith("zero"):
            zero.set_reshard_after_forward(model.blocks[-1], False)
        else:
            model.blocks[-1].set_reshard_after_forward(False)
    sys_.step(rank, s)


def test_keeping_the_last_block_gathered_after_forward_matches_fsdp2():
    assert run_ranks(compare, 2, GPT, "fsdp2", ["zero3"], {"step": _keep_last_block}) == [[], []]


def _accumulate_without_regathering(rank, n):
    torch.manual_seed(0)
    base = GPT()
    systems = [System(k, base, "adamw") for k in ("fsdp2", "zero3")]
    failures, gathers = [], []
    for s in range(2):
        for sys_ in systems:
            ours = sys_.kind == "zero3"
            with zero.Ledger() as ledger:
                for m in range(3):
                    last = m == 2
                    if ours:
                        zero.set_reshard_after_backward(sys_.model, last)
                        zero.set_requires_gradient_sync(sys_.model, last)
                    else:
                        sys_.model.set_reshard_after_backward(last)
                        sys_.model.set_requires_gradient_sync(last)
                    x, y = batch_of(sys_, rank, s, m)
                    sys_.base.loss(sys_.model(x), y).backward()
            if ours:
                gathers.append(len(_gathers(ledger)))
            sys_.opt.step()
            sys_.opt.zero_grad()
        if (diff := first_difference(systems[1].full_params(), systems[0].full_params())):
            failures.append(f"step {s}: {diff}")
    return failures, gathers


def test_reshard_after_backward_false_saves_gathers_across_micro_batches():
    failures, gathers = run_ranks(_accumulate_without_regathering, 2)[0]
    assert failures == []
    # 3 micro-batches: normally the root and 2 blocks in each forward, the 2 blocks again in
    # each backward (15); kept after backward, the next forwards gather nothing: 5 + 2 + 2.
    assert gathers == [9, 9], gathers


class TiedGroup(GPT):
    """The torchtitan way: the tied embedding and head are one unit of two modules."""

    def units(self):
        return [*self.blocks, [self.tok_emb, self.head], self]


def test_one_unit_of_two_modules_matches_ddp_and_fsdp2():
    assert run_ranks(compare, 2, TiedGroup, "ddp", ZERO + ["fsdp2"]) == [[], []]


def _ignored(rank, n, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT()
    ignored = {model.pos_emb.weight}
    for unit in model.units():
        if kind == "fsdp2":
            fully_shard(unit, mesh=init_device_mesh("cpu", (n,)), ignored_params=ignored)
        else:
            zero.shard(unit, stage=int(kind[-1]), ignored_params=ignored)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        x, y = model.batch(2, torch.Generator().manual_seed(10 * s + rank))
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.pos_emb.weight.detach().clone(), isinstance(model.pos_emb.weight, torch.Tensor)


@pytest.mark.parametrize("stage", [1, 3])
def test_ignored_params_stay_whole_and_local_like_fsdp2(stage):
    # Neither FSDP2 nor zero reduces an ignored parameter's gradient: each rank trains its own.
    theirs = run_ranks(_ignored, 2, "fsdp2")
    ours = run_ranks(_ignored, 2, f"zero{stage}")
    for (t, _), (o, whole) in zip(theirs, ours):
        assert whole and o.shape == (16, 32) and torch.equal(o, t)
    assert not torch.equal(ours[0][0], ours[1][0])  # not synchronised: rank-local updates
