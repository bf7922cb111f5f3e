"""Disk offload (zero/features/disk_offload.py): the optimizer state in files, the bits unchanged.

What must hold: training bitwise equal to the in-memory run at every stage, fp32 and bf16
compute; between steps no optimizer state in memory; every read and write in the ledger, the
unit's state to the byte; at most two units' state held at once; a checkpoint saved and
resumed through the files as through memory; and training under a memory limit that the
in-memory run exceeds (benchmarks/disk_limit.py's runs).
"""

import os
import sys

import pytest
import torch

import zero
from compare import GPT, train_steps
from conftest import sample
from harness import run_ranks
from zerolab.models import GPTConfig


def _model(stage, mp, offload):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    policy = zero.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    for unit in model.units():
        zero.shard(unit, stage=stage, mp_policy=policy, offload_policy=offload)
    return model


def _state_bytes(tensors) -> int:
    return sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)


def _train(rank, n, stage, mp, directory, steps=3):
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else None
    model = _model(stage, mp, offload)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() > 1]},
                             {"params": [p for p in model.parameters() if p.dim() <= 1],
                              "weight_decay": 0.0}], lr=1e-2)
    losses, ledgers = train_steps(model, opt, rank, steps)
    out = {"losses": losses, "params": zero.full_state_dict(model)}
    if directory:
        store = zero.features.disk_offload.stores_of(opt)[0]
        units = zero.units_of(model)
        # The in-memory state a unit holds is its parameters' exp_avg and exp_avg_sq (fp32,
        # the piece's shape), each at a multiple of 64 bytes in the unit's buffer.
        per_unit = {u.name: _state_bytes([p.detach() for p in u.params if p.numel()] * 2)
                    for u in units}
        out["formula"] = per_unit
        out["records"] = [[(r.op, r.unit, r.buffer_bytes, r.sent_bytes) for r in lg.records
                           if r.op in ("read", "write")] for lg in ledgers]
        out["state_between_steps"] = sum(len(s) for s in opt.state.values())
        out["peak"], out["two_largest"] = store.peak_bytes, sum(sorted(per_unit.values())[-2:])
        out["files"] = sorted(f for f in os.listdir(store.root) if f.endswith(".state"))
        out["root"] = store.root
        del opt, store
        import gc

        gc.collect()
        out["removed"] = not os.path.exists(out["root"])
    return out


CASES = [(1, False), (2, False), (3, False), (3, True)]
EVERY = [(s, mp) for s in (1, 2, 3) for mp in (False, True)]


@pytest.mark.parametrize("stage,mp", sample(CASES, EVERY))
def test_disk_offload_trains_bitwise_like_memory_and_counts_every_byte(stage, mp, tmp_path):
    plain = run_ranks(_train, 2, stage, mp, None)
    disk = run_ranks(_train, 2, stage, mp, str(tmp_path))
    for p, d in zip(plain, disk):
        assert all(torch.equal(a, b) for a, b in zip(p["losses"], d["losses"]))
        assert all(torch.equal(p["params"][k], d["params"][k]) for k in p["params"])
        units = d["formula"]
        first, *later = d["records"]
        # The first step makes the state and writes it; each later one reads it and writes it.
        assert sorted(first) == sorted(("write", u, b, 0) for u, b in units.items())
        for records in later:
            assert sorted(records) == sorted([("read", u, b, 0) for u, b in units.items()]
                                             + [("write", u, b, 0) for u, b in units.items()])
        assert d["state_between_steps"] == 0  # all of it is in the files
        assert 0 < d["peak"] <= d["two_largest"]
        assert len(d["files"]) == len(units)
        assert d["removed"]  # the store's own directory goes with the optimizer


def test_disk_offload_at_world_size_3(tmp_path):
    plain, disk = run_ranks(_train, 3, 3, True, None), run_ranks(_train, 3, 3, True, str(tmp_path))
    for p, d in zip(plain, disk):
        assert all(torch.equal(a, b) for a, b in zip(p["losses"], d["losses"]))
        assert all(torch.equal(p["params"][k], d["params"][k]) for k in p["params"])


def _resume(rank, n, directory, ckpt):
    """Two steps, save, two more; and a fresh model loading the checkpoint, then two more."""
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else None
    model = _model(3, False, offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, rank, 2)
    zero.save(ckpt, model, opt)
    resident_after_save = sum(len(s) for s in opt.state.values())
    going_on, _ = train_steps(model, opt, rank, 2, first=2)
    fresh = _model(3, False, offload)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    train_steps(fresh, opt2, rank, 1, first=7)  # (its own state, replaced by the load)
    zero.load(ckpt, fresh, opt2)
    resident_after_load = sum(len(s) for s in opt2.state.values())
    resumed, _ = train_steps(fresh, opt2, rank, 2, first=2)
    return going_on, resumed, resident_after_save, resident_after_load


def test_a_checkpoint_goes_through_the_files(tmp_path):
    plain = run_ranks(_resume, 2, None, str(tmp_path / "mem"))
    disk = run_ranks(_resume, 2, str(tmp_path / "disk"), str(tmp_path / "ckpt"))
    for (p_on, p_res, *_), (d_on, d_res, after_save, after_load) in zip(plain, disk):
        assert all(torch.equal(a, b) for a, b in zip(p_on + p_res, d_on + d_res))
        assert all(torch.equal(a, b) for a, b in zip(d_on, d_res))  # resumed = went on
        assert after_save == after_load == 0  # back in the files both times


def _refused(rank, n, directory, what):
    model = _model(3, False, zero.DiskOffload(directory))
    opt = (torch.optim.Adagrad if what == "closure" else torch.optim.LBFGS)(model.parameters())
    x, y = model.batch(4, torch.Generator().manual_seed(rank))
    model.loss(model(x), y).backward()
    try:
        opt.step((lambda: None) if what == "closure" else None)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "stepped"


@pytest.mark.parametrize("what", ["closure", "lbfgs"])
def test_a_step_disk_offload_cannot_split_is_refused(what, tmp_path):
    message = run_ranks(_refused, 2, str(tmp_path), what)[0]
    assert ("closure" in message) if what == "closure" else ("LBFGS" in message)


# ---- under a memory limit ------------------------------------------------------------------


@pytest.mark.full  # 13 s: three fresh interpreters (benchmarks/results/*-disk.md has its figures)
def test_disk_offload_trains_under_a_memory_limit_the_in_memory_run_exceeds():
    """benchmarks/disk_limit.py's three runs, each in a fresh interpreter: 8 units of 1024 x
    1024, AdamW's state 32 MiB a rank, the address space allowed to grow by 24 MiB."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import disk_limit

    reference, in_memory, on_disk = disk_limit.measure(layers=8, dim=1024, budget_mib=24, steps=3)
    assert in_memory["budget"] == on_disk["budget"] == 24 << 20 and not reference["budget"]
    for ref, mem, disk in zip(reference["ranks"], in_memory["ranks"], on_disk["ranks"]):
        assert disk["state"] > on_disk["budget"]  # the state alone is more than the limit allows
        assert "can't allocate memory" in mem["error"] or "waited" in mem["error"]
        assert disk["params_sha256"] == ref["params_sha256"]  # bitwise the unlimited run
        assert disk["held"] <= 2 * disk["state"] / 8  # two units' state at most
    assert any("can't allocate memory" in mem["error"] for mem in in_memory["ranks"])


def _with_ignored(rank, n, directory):
    """A parameter left whole (ignored_params) is stepped by the call itself, in memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else None
    zero.shard(model[0], stage=3, offload_policy=offload)
    zero.shard(model, stage=3, offload_policy=offload, ignored_params={model[1].bias})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    in_memory = sorted(k for p, st in opt.state.items() for k in st)  # the ignored one's only
    return zero.full_state_dict(model), model[1].bias.detach().clone(), in_memory


def test_parameters_outside_the_units_are_stepped_in_memory(tmp_path):
    plain = run_ranks(_with_ignored, 2, None)
    disk = run_ranks(_with_ignored, 2, str(tmp_path))
    for (p0, b0, _), (p1, b1, state) in zip(plain, disk):
        assert all(torch.equal(p0[k], p1[k]) for k in p0) and torch.equal(b0, b1)
        assert state == ["exp_avg", "exp_avg_sq", "step"]  # the ignored bias, in memory


def _rows(rank, n, directory):
    try:
        zero.shard(GPT(GPTConfig()), stage=3, layout="rows",
                   offload_policy=zero.DiskOffload(directory))
    except ValueError as e:
        return str(e)
    return "sharded"


def test_layout_rows_is_refused(tmp_path):
    assert "does not support layout='rows'" in run_ranks(_rows, 2, str(tmp_path))[0]


# ---- state that appears later, a step that fails, a load into a fresh optimizer ------------


class _Branch(torch.nn.Module):
    """Two units; the second is used on some steps only (a branch not taken)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_b):
        x = self.a(x)
        return self.b(x) if use_b else x


def _branch(rank, n, directory, optimizer, schedule):
    torch.manual_seed(0)
    model = _Branch()
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else \
        zero.CPUOffload()
    for m in (model.a, model.b, model):
        zero.shard(m, stage=3, offload_policy=offload)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9))
    for s, use_b in enumerate(schedule):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        model(x, use_b).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return zero.full_state_dict(model)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_unit_first_stepped_later_keeps_its_state(optimizer, tmp_path):
    """Unit b gets no gradient at the first step, so no state then: its state, made at the
    second step, must be kept like any other (momentum was reset each step, AdamW raised)."""
    schedule = [False, True, True, True]
    memory = run_ranks(_branch, 2, None, optimizer, schedule)
    disk = run_ranks(_branch, 2, str(tmp_path), optimizer, schedule)
    for m, d in zip(memory, disk):
        assert all(torch.equal(m[k], d[k]) for k in m)


def _branch_on_disk(rank, directory):
    """A _Branch sharded unit by unit with its optimizer state in files, its optimizer, a batch."""
    torch.manual_seed(0)
    model = _Branch()
    for m in (model.a, model.b, model):
        zero.shard(m, stage=3, offload_policy=zero.DiskOffload(os.path.join(directory, f"r{rank}")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _fails_then_retries(rank, n, directory):
    model, opt, x = _branch_on_disk(rank, directory)
    for _ in range(2):
        model(x, True).square().mean().backward()
        opt.step()
    model(x, True).square().mean().backward()
    good, model.b.weight.grad = model.b.weight.grad, model.b.weight.grad.to_sparse()
    try:
        opt.step()  # unit a is stepped first, then AdamW refuses b's sparse gradient
    except RuntimeError:
        pass
    model.b.weight.grad = good
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "stepped again"


def test_a_step_that_failed_part_way_refuses_the_next_one(tmp_path):
    """Stepping again would step the units before the failure twice: it raises, naming them."""
    for message in run_ranks(_fails_then_retries, 2, str(tmp_path)):
        assert "failed part way" in message and "zero.load" in message, message


def _fresh_load(rank, n, directory, ckpt):
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}"))
    model = _model(3, False, offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, rank, 2)
    zero.save(ckpt, model, opt)
    fresh = _model(3, False, offload)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    zero.load(ckpt, fresh, opt2)  # the usual resume: into an optimizer that never stepped
    return sum(len(s) for s in opt2.state.values())


def test_a_load_into_a_fresh_optimizer_puts_the_state_in_the_files(tmp_path):
    assert run_ranks(_fresh_load, 2, str(tmp_path / "d"), str(tmp_path / "c")) == [0, 0]


# ---- the step in torch's order, a stable identity for each unit's state, two roots ---------


def _warmup_hook(opt, args, kwargs):
    """A user's own step pre-hook: this step's lr, set before any parameter is updated."""
    opt._steps = getattr(opt, "_steps", 0) + 1
    for g in opt.param_groups:
        g["lr"] = 1e-2 * opt._steps / 3


def _with_step_pre_hook(rank, n, directory):
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else \
        zero.CPUOffload()
    model = _model(3, False, offload)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(_warmup_hook)
    train_steps(model, opt, rank, 3)
    return zero.full_state_dict(model)


def test_a_users_step_pre_hook_sees_the_step_before_any_update(tmp_path):
    """The user's hook sets this step's lr: under disk offload it must apply to this step (it
    applied one step late when the disk units were stepped in a hook that ran before it)."""
    memory = run_ranks(_with_step_pre_hook, 2, None)
    disk = run_ranks(_with_step_pre_hook, 2, str(tmp_path))
    for m, d in zip(memory, disk):
        assert all(torch.equal(m[k], d[k]) for k in m)


def _load_then_save(rank, n, directory, ckpt):
    """Train, save; a fresh model loads it and saves again with no forward in between (a
    conversion script); a third model resumes from that second checkpoint."""
    offload = (lambda: zero.DiskOffload(os.path.join(directory, f"r{rank}"))) if directory \
        else zero.CPUOffload
    model = _model(3, False, offload())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, rank, 2)
    zero.save(os.path.join(ckpt, "a"), model, opt)
    going_on, _ = train_steps(model, opt, rank, 2, first=2)
    fresh = _model(3, False, offload())
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    zero.load(os.path.join(ckpt, "a"), fresh, opt2)
    zero.save(os.path.join(ckpt, "b"), fresh, opt2)  # no forward: units still named by class
    third = _model(3, False, offload())
    opt3 = torch.optim.AdamW(third.parameters(), lr=1e-2)
    zero.load(os.path.join(ckpt, "b"), third, opt3)
    resumed, _ = train_steps(third, opt3, rank, 2, first=2)
    return going_on, resumed


def test_load_then_save_with_no_forward_keeps_every_units_state(tmp_path):
    memory = run_ranks(_load_then_save, 2, None, str(tmp_path / "m"))
    disk = run_ranks(_load_then_save, 2, str(tmp_path / "d"), str(tmp_path / "c"))
    for (m_on, m_res), (d_on, d_res) in zip(memory, disk):
        assert all(torch.equal(a, b) for a, b in zip(m_on + m_res, d_on + d_res))
        assert all(torch.equal(a, b) for a, b in zip(d_on, d_res))  # resumed = went on


def _two_roots(rank, n, directory):
    """Two separately sharded models (two roots), one optimizer over both."""
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else \
        zero.CPUOffload()
    torch.manual_seed(0)
    a, b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), \
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for model in (a, b):
        zero.shard(model[0], stage=3, offload_policy=offload)
        zero.shard(model, stage=3, offload_policy=offload)
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=1e-2)
    for s in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        b(a(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return zero.full_state_dict(a), zero.full_state_dict(b)


def test_two_roots_in_one_optimizer_train_as_in_memory(tmp_path):
    memory = run_ranks(_two_roots, 2, None)
    disk = run_ranks(_two_roots, 2, str(tmp_path))
    for m, d in zip(memory, disk):
        for mm, dd in zip(m, d):
            assert all(torch.equal(mm[k], dd[k]) for k in mm)


def _resumed(rank, n, directory, ckpt, opt_name):
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else \
        zero.CPUOffload()
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[opt_name]
    model = _model(3, False, offload)
    opt = make(model.parameters())
    train_steps(model, opt, rank, 2)
    zero.save(ckpt, model, opt)
    fresh = _model(3, False, offload)  # the usual resume: build, shard, optimizer, load, train
    opt = make(fresh.parameters())
    zero.load(ckpt, fresh, opt)  # before any forward: units are still named by their class
    train_steps(fresh, opt, rank, 2, first=2)
    return zero.full_state_dict(fresh)


@pytest.mark.parametrize("opt_name", sample(["adamw"], ["sgd", "adamw"]))
def test_a_resume_before_the_first_forward_trains_on_as_cpu_offload(opt_name, tmp_path):
    """The state loaded before the first forward went into files keyed by the units' class
    names, which the first forward changed: SGD's momentum restarted silently, AdamW raised
    KeyError 'exp_avg'. Files are keyed by the unit itself now."""
    disk = run_ranks(_resumed, 2, str(tmp_path / "d"), str(tmp_path / "c1"), opt_name)
    memory = run_ranks(_resumed, 2, None, str(tmp_path / "c2"), opt_name)
    for d, m in zip(disk, memory):
        assert all(torch.equal(d[k], m[k]) for k in m)


def _interrupted_then_saved(rank, n, directory, ckpt):
    """Ctrl-C in the middle of opt.step() (between two units), then an emergency save."""
    import torch.optim.adam as adam

    model, opt, x = _branch_on_disk(rank, directory)
    model(x, True).square().mean().backward()
    opt.step()
    model(x, True).square().mean().backward()
    calls, step = [], adam._single_tensor_adam

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # unit a stepped, unit b not
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    adam._single_tensor_adam = interrupted
    try:
        opt.step()
    except KeyboardInterrupt:
        pass
    finally:
        adam._single_tensor_adam = step
    said = []
    for attempt in (lambda: zero.save(ckpt, model, opt), opt.step):
        try:
            attempt()
            said.append("accepted")
        except RuntimeError as e:
            said.append(str(e))
    return said


def test_a_save_after_a_step_interrupted_part_way_is_refused(tmp_path):
    """The saved units would disagree on their step count (AdamW's ``step`` 1 for some, 2 for
    others): the save raises, naming the fix, and the next step still refuses."""
    for save, step in run_ranks(_interrupted_then_saved, 2, str(tmp_path / "d"),
                                str(tmp_path / "c")):
        assert "failed part way" in save and "different steps" in save, save
        assert "failed part way" in step and "zero.load" in step, step
    assert not (tmp_path / "c" / "latest").exists()
