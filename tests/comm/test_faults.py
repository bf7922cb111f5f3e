"""The fault matrix: habits from DDP, FSDP2 and DeepSpeed, misuse and rank divergence.

Every case runs in fresh ranks with a timeout and ends one of two ways: it works as a user of
DDP or FSDP2 expects (compared with a reference), or every rank raises, within 10 s, an
error that names the fix. None may hang or quietly diverge. The tests run in check mode
(tests/conftest.py): every collective is preceded by an agreement (zero/comm/agree.py); the
default mode, where every wait is bounded instead (zero/comm/waits.py), has cases of its own.
"""

import copy
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from compare import DIM, ZERO, Net, System, Tanh, batch_of, compare, make_optimizer
from conftest import sample
from harness import run_ranks


def _model(stage, blocks=3, **kw):
    torch.manual_seed(0)
    model = Net([Tanh() for _ in range(blocks)])
    for unit in model.units():
        zero.shard(unit, stage=stage, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, rank, s, backward=True, step=True):
    x, y = model.batch(4, torch.Generator().manual_seed(10 * s + rank))
    loss = model.loss(model(x), y)
    if backward:
        loss.backward()
    if step:
        opt.step()
        opt.zero_grad()


# ---- cases that must raise on every rank ------------------------------------------------------

class Skipping(Net):
    """Runs ``blocks[1]`` ``times[rank]`` times (1 is the normal path)."""

    times = (1, 1)

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            for _ in range(self.times[dist.get_rank()] if i == 1 else 1):
                x = block(x)
        return self.out(x)


def _unit_runs(rank, times):
    torch.manual_seed(0)
    model = Skipping([Tanh() for _ in range(3)])
    for unit in model.units():
        zero.shard(unit, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, 0)
    model.times = times
    _step(model, opt, rank, 1)


def _no_sync_counts(rank, stage):
    model, opt = _model(stage)
    for micro in range(2 if rank == 0 else 1):  # rank 0 accumulates one micro-batch more
        with zero.no_sync(model):
            _step(model, opt, rank, micro, step=False)
    _step(model, opt, rank, 9)
    _step(model, opt, rank, 10)


def _backward_on_one_rank(rank, stage):
    model, opt = _model(stage)
    _step(model, opt, rank, 0, backward=rank == 0)
    _step(model, opt, rank, 1)


def _step_on_one_rank(rank, stage):
    """A GradScaler that found inf on its own shard, or an `if finite:` on a local value."""
    model, opt = _model(stage)
    _step(model, opt, rank, 0, step=rank == 0)
    _step(model, opt, rank, 1)


def _helper_on_rank0_only(rank, helper, tmp):
    """The DDP habit: `if rank == 0: save(...)`; the other rank trains on."""
    model, opt = _model(2)
    _step(model, opt, rank, 0)
    if rank == 0:
        {"full_state_dict": lambda: zero.full_state_dict(model),
         "save": lambda: zero.save(tmp, model, opt),
         "clip": lambda: zero.clip_grad_norm_(model, 1.0)}[helper]()
    _step(model, opt, rank, 1)


def _state_dict(rank, which):
    model, _ = _model(1)
    if which == "state_dict":
        model.state_dict()
    else:
        model.load_state_dict({k: v.clone() for k, v in Net([Tanh()] * 3).state_dict().items()})


def _nan_on_one_shard(rank):
    model, opt = _model(2)
    _step(model, opt, rank, 0, step=False)
    if rank == 1:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = torch.nan
    zero.clip_grad_norm_(model, 1.0, norm_type=float("inf"), error_if_nonfinite=True)


def _shared_with_outside(rank):
    torch.manual_seed(0)
    model = Net([Tanh() for _ in range(2)])
    outside = nn.Linear(DIM, DIM)
    outside.weight = model.blocks[0].lin.weight  # a module outside the model shares it
    for unit in model.units():
        zero.shard(unit, stage=2)
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    (model.loss(model(x), y) + outside(x).sum()).backward()


def _converted(rank, how):
    model, opt = _model(3)
    {"double": model.double, "half": model.half}[how]()
    _step(model, opt, rank, 0)


def _deepcopy(rank):
    model, _ = _model(1)
    copy.deepcopy(model)  # an EMA copy, the usual way


def _different_models(rank, stage):
    model = nn.Sequential(nn.Linear(4, 8 if rank == 0 else 6), nn.Linear(8 if rank == 0 else 6, 2))
    zero.shard(model, stage=stage)


DIVERGE = "the ranks took different paths"
ERRORS = {
    "stage 3: a rank skips a unit": (lambda r, t: _unit_runs(r, (1, 0)), DIVERGE),
    "stage 3: a rank runs a unit twice": (lambda r, t: _unit_runs(r, (1, 2)), DIVERGE),
    **{f"stage {s}: ranks run different numbers of no_sync micro-batches":
       (lambda r, t, s=s: _no_sync_counts(r, s), DIVERGE) for s in (1, 2, 3)},
    **{f"stage {s}: backward on one rank only": (lambda r, t, s=s: _backward_on_one_rank(r, s),
                                                 DIVERGE) for s in (1, 2, 3)},
    **{f"stage {s}: opt.step() on one rank only": (lambda r, t, s=s: _step_on_one_rank(r, s),
                                                   "ShardedGradScaler") for s in (1, 2, 3)},
    **{f"{h} on rank 0 only": (lambda r, t, h=h: _helper_on_rank0_only(r, h, t), DIVERGE)
       for h in ("full_state_dict", "save", "clip")},
    "model.state_dict() of a sharded model": (lambda r, t: _state_dict(r, "state_dict"),
                                              "zero.full_state_dict(model)"),
    "model.load_state_dict() of a full state": (lambda r, t: _state_dict(r, "load"),
                                                "zero.load_full_state_dict"),
    "inf-norm clipping, NaN on rank 1's shard": (lambda r, t: _nan_on_one_shard(r),
                                                 "total norm of order inf is nan"),
    "a parameter shared with a module outside": (lambda r, t: _shared_with_outside(r),
                                                 "Shard a module that contains every user"),
    "model.double() after sharding": (lambda r, t: _converted(r, "double"),
                                      "Convert the model before zero.shard"),
    "model.half() after sharding": (lambda r, t: _converted(r, "half"),
                                    "Convert the model before zero.shard"),
    "copy.deepcopy of a sharded model": (lambda r, t: _deepcopy(r), "Copy the model before"),
    **{f"stage {s}: ranks with different models": (lambda r, t, s=s: _different_models(r, s),
                                                   "Ranks shard different modules")
       for s in (1, 2)},
    "fp16: torch's plain GradScaler finds inf on one rank's shard":
        (lambda r, t: _scaled_training(r, 2, "plain"), "zero.ShardedGradScaler"),
}


def _raise_case(rank, n, name, tmp):
    start = time.monotonic()
    try:
        ERRORS[name][0](rank, tmp)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "nothing raised", time.monotonic() - start


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(ERRORS))
def test_every_rank_raises_an_error_naming_the_fix(name, tmp_path):
    os.environ["ZERO_TIMEOUT"] = "8"  # a rank left alone gives up in time (check mode)
    try:
        results = run_ranks(_raise_case, 2, name, str(tmp_path / "ckpt"), timeout=30)
    finally:
        os.environ["ZERO_TIMEOUT"] = "30"
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind is not None, f"rank {rank}: {message}"
        assert ERRORS[name][1] in message or DIVERGE in message, f"rank {rank}: {message}"
        assert seconds < 10, f"rank {rank} raised after {seconds:.1f} s"


def _mismatch_message(rank, n):
    try:
        _different_models(rank, 2)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_model_mismatch_names_the_first_parameter_that_differs_first():
    message = run_ranks(_mismatch_message, 2)[0]
    head = message.split(". Build")[0]
    assert head == ("Ranks shard different modules: parameter #0 differs: rank 0: '0.weight' "
                    "(8, 4) torch.float32; rank 1: '0.weight' (6, 4) torch.float32"), message


# ---- default mode: every wait is bounded --------------------------------------------------------
# Users run without ZERO_CHECK. There a rank left alone in a collective must still raise, on its
# own, within ZERO_TIMEOUT (zero/comm/waits.py), naming what it waited for, instead of waiting
# for the process group's timeout (30 minutes by default; run_ranks sets it to the test's 30 s).

BOUND = 2  # ZERO_TIMEOUT for these cases, seconds


def _eval_on_rank0_only(rank, stage):
    model, opt = _model(stage)
    _step(model, opt, rank, 0)
    if rank == 0:  # DDP's habit: evaluate on rank 0 alone
        with torch.no_grad():
            _step(model, opt, rank, 1, backward=False, step=False)
    _step(model, opt, rank, 2)


def _caught_step_failure(rank):
    model, opt = _model(1)
    _step(model, opt, rank, 0)
    try:
        if rank == 1:
            raise ZeroDivisionError("the optimizer failed on this rank")  # e.g. an empty piece
        _step(model, opt, rank, 1)
    except ZeroDivisionError:
        time.sleep(BOUND + 1)  # a harness that logs and goes on with something else
        return None
    return None


TIMEOUT = "the other ranks never joined it"
DEFAULT_MODE = {
    "stage 3: a rank skips a unit": (lambda r: _unit_runs(r, (1, 0)), TIMEOUT, (0, 1)),
    "stage 3: a rank runs a unit twice": (lambda r: _unit_runs(r, (1, 2)), TIMEOUT, (0, 1)),
    **{f"stage {s}: backward on one rank only": (lambda r, s=s: _backward_on_one_rank(r, s),
                                                 TIMEOUT, (0, 1)) for s in (1, 2)},
    **{f"stage {s}: an evaluation forward on rank 0 only": (
        lambda r, s=s: _eval_on_rank0_only(r, s), "run it on every rank", (0, 1)) for s in (1, 2)},
    "stage 1: an optimizer raises on one rank, which goes on": (_caught_step_failure, TIMEOUT, (0,)),
}


def _default_mode_case(rank, n, name):
    os.environ["ZERO_CHECK"], os.environ["ZERO_TIMEOUT"] = "0", str(BOUND)  # this rank only
    start = time.monotonic()
    try:
        DEFAULT_MODE[name][0](rank)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "nothing raised", time.monotonic() - start


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sample(
    [n for n in DEFAULT_MODE if not n.startswith(("stage 2: backward", "stage 1: an evaluation"))],
    list(DEFAULT_MODE)))
def test_default_mode_every_waiting_rank_raises_within_the_bound(name):
    results = run_ranks(_default_mode_case, 2, name, timeout=30)
    _, expected, waiting = DEFAULT_MODE[name]
    for rank in waiting:
        kind, message, seconds = results[rank]
        assert kind in ("CollectiveTimeout", "AgreementTimeout", "Disagreement"), (
            f"rank {rank}: {kind}: {message}")
        assert expected in message, f"rank {rank}: {message}"
        if expected == TIMEOUT:  # it says what it waited for, and what usually causes it
            assert "collective #" in message and "ZERO_TIMEOUT" in message, message
            assert "a rank skipped a forward, a backward or an opt.step()" in message, message
        assert seconds < BOUND + 4, f"rank {rank} raised after {seconds:.1f} s"


# ---- cases that must work as the references do -------------------------------------------------

def _edit_in_place(sys_, rank, s):
    if s == 1:
        with torch.no_grad():
            for p in sys_.model.parameters():
                p.mul_(0.5)  # a manual update, without torch.optim
    sys_.step(rank, s)


def _zero_grad_after_no_sync(sys_, rank, s):
    x, y = batch_of(sys_, rank, s, 0)
    with sys_.no_sync():
        sys_.base.loss(sys_.model(x), y).backward()
    sys_.opt.zero_grad()  # DDP: this micro-batch is gone
    x, y = batch_of(sys_, rank, s, 1)
    sys_.base.loss(sys_.model(x), y).backward()
    sys_.opt.step()
    sys_.opt.zero_grad()


def _two_optimizers(rank, n, stage):
    torch.manual_seed(0)
    model, _ = _model(stage)
    params = list(model.blocks[0].parameters())  # one unit, two optimizers
    opts = [torch.optim.SGD(params[:1], lr=0.1), torch.optim.SGD(params[1:], lr=0.1)]
    _step(model, opts[0], rank, 0, step=False)
    for opt in opts:
        opt.step()
    with zero.Ledger() as ledger:
        model(model.batch(2, torch.Generator())[0])
    return [r.unit for r in ledger.records if r.op == "all_gather" and r.phase == "step"]


def _batchnorm(rank, n):
    torch.manual_seed(0)
    base = BatchNormNet([Tanh(), Tanh()])
    ddp = System("ddp", base, "adamw")
    ours = copy.deepcopy(base)
    for unit in ours.units():
        zero.shard(unit, stage=2, broadcast_buffers=unit is ours)
    opt = make_optimizer("adamw", list(ours.named_parameters()))
    failures = []
    for s in range(3):
        ddp.step(rank, s)
        x, y = base.batch(4, torch.Generator().manual_seed(1000 * s + 10 * rank))
        base.loss(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
        theirs = ddp.model.module.state_dict()
        mine = zero.full_state_dict(ours)
        failures += [f"step {s}: {k}" for k in theirs if not torch.equal(theirs[k], mine[k])]
    return failures


class BatchNormNet(Net):
    def __init__(self, blocks):
        super().__init__(blocks)
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x):
        return super().forward(self.norm(x))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_edited_in_place_reaches_the_full_parameters(stage):
    make = lambda: Net([Tanh() for _ in range(2)])  # noqa: E731
    opts = {"step": _edit_in_place}
    assert run_ranks(compare, 2, make, "replicated", [f"zero{stage}"], opts) == [[], []]


def test_zero_grad_after_a_no_sync_micro_batch_discards_it_like_ddp():
    # (FSDP2 keeps the unsynced micro-batch: it lives in gradients zero_grad does not see.)
    make = lambda: Net([Tanh() for _ in range(2)])  # noqa: E731
    opts = {"step": _zero_grad_after_no_sync}
    assert run_ranks(compare, 2, make, "ddp", ZERO, opts) == [[], []]


@pytest.mark.parametrize("stage", [1, 2])
def test_two_optimizers_over_one_unit_gather_it_once(stage):
    assert run_ranks(_two_optimizers, 2, stage)[0] == ["blocks.0"]


def test_broadcast_buffers_trains_batchnorm_like_ddp():
    assert run_ranks(_batchnorm, 2) == [[], []]


# ---- fp16 with a gradient scaler: found_inf must be agreed ----------------------------------

def _scaled_training(rank, n, scaler_kind):
    """fp16 compute, fp32 reduction; at step 1 rank 1 alone finds an inf in its shard. Returns
    (what differs from FSDP2 + its ShardedGradScaler, the scales) for ours + ``scaler_kind``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))
    fsdp, ours = copy.deepcopy(base), copy.deepcopy(base)
    for unit in (fsdp[0], fsdp[2], fsdp):
        fully_shard(unit, mesh=init_device_mesh("cpu", (n,)),
                    mp_policy=MixedPrecisionPolicy(torch.float16, torch.float32))
    for unit in (ours[0], ours[2], ours):
        zero.shard(unit, stage=3, mp_policy=zero.MixedPrecision(torch.float16, torch.float32))
    scalers = [TorchScaler("cpu", init_scale=2.0**8),
               {"sharded": zero.ShardedGradScaler, "plain": torch.amp.GradScaler}[scaler_kind](
                   "cpu", init_scale=2.0**8)]
    models = [fsdp, ours]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    failures, scales = [], []
    for s in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        for model, opt, scaler in zip(models, opts, scalers):
            scaler.scale(model(x).float().square().mean()).backward()
            if s == 1 and rank == 1:  # an overflow in element (6, 0) of 0.weight: rank 1's rows
                g = model[0].weight.grad
                if hasattr(g, "to_local"):
                    g.to_local()[2, 0] = torch.inf  # FSDP2: rows 4..7 of the (8, 8) weight
                else:
                    g[16] = torch.inf  # ours: flat elements 32..63 of the unit's 64
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append([sc.get_scale() for sc in scalers])
        ref = {k: v.full_tensor() for k, v in fsdp.state_dict().items()}
        mine = zero.full_state_dict(ours)
        failures += [f"step {s}: {k}" for k in ref if not torch.equal(ref[k], mine[k])]
    return failures, scales


def test_sharded_grad_scaler_agrees_on_found_inf_like_fsdp2():
    for failures, scales in run_ranks(_scaled_training, 2, "sharded"):
        assert failures == []
        assert scales == [[256.0, 256.0], [128.0, 128.0], [128.0, 128.0]]  # step 1 skipped


def test_the_default_mode_matrix_tells_a_named_error_from_a_death(tmp_path):
    """benchmarks/faults.py runs this file's cases in the default mode and sorts the endings
    (the figures in notes/13). Two of its cases, checked here: a misuse every rank names, and
    collectives of different sizes, where gloo's size check kills the receiving process from
    its own thread (an abort: SIGABRT, exit code -6; once in three of the lead's runs the abort
    raced a segfault, -11). What is true either way: the process died of a signal, after gloo
    said why. The day gloo raises instead, this fails and the chapter must change.

    The dying rank's stderr and fatal-error dump go to files, shown only if this fails: in a
    green run, "Fatal Python error: Aborted" and 60 lines of stack on the screen read as a
    crash."""
    import re

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import faults

    assert faults.run_case("model.double() after sharding", str(tmp_path))[0] == "named"
    ending, said = faults.run_case("stage 3: a rank skips a unit of another size", str(tmp_path))
    died = re.search(r"rank (\d) died with exit code (-?\d+)", said)
    printed = died and (tmp_path / f"rank{died.group(1)}.txt").read_text()
    assert ending == "died" and int(died.group(2)) < 0, (said, printed)  # a signal
    assert "Received data size doesn't match expected size" in printed, (said, printed)
    assert "Fatal Python error" in printed  # the dump of its stack: in the file, not on screen
