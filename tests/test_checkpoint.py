"""Checkpoints (zero/checkpoint/dcp.py): exact resume, resharding, FSDP2 both ways, atomicity, errors.

Every "bitwise" below is ``torch.equal``. A resume runs in fresh ranks, from a model built with
another seed, so everything it gets right came from the checkpoint.
"""

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import zero
import zero.checkpoint
import zero.checkpoint.directory
from compare import MODELS, System, first_difference, max_relative_difference
from harness import RankError, run_ranks
from zerolab.models import GPT, GPTConfig


class Scalars(nn.Module):
    """A 0-d parameter, a (0, 4) one and a 1-element one: at world size 3, ranks hold empty
    pieces and padding only. FSDP2 cannot shard a 0-d parameter, so only ours runs this."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.shift = nn.Parameter(torch.zeros(1))
        self.nothing = nn.Parameter(torch.zeros(0, 4))
        self.scale = nn.Parameter(torch.tensor(1.5))  # last in its unit, after an empty one

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift + self.nothing.sum()

    def units(self):
        return [self.lin, self]

    def batch(self, batch, generator):
        return torch.randn(batch, 3, generator=generator), torch.randn(batch, 2, generator=generator)

    @staticmethod
    def loss(out, target):
        return F.mse_loss(out, target)


MODELS = {**MODELS, "scalars": Scalars}
STEPS = 3


def _system(model, kind, opt, seed=0):
    torch.manual_seed(seed)
    return System(kind, MODELS[model](), opt)


def _train(system, rank, steps):
    for s in steps:
        system.step(rank, s)


def _local_state(system):
    """Our optimizer state: this rank's pieces, by name (to compare at the same world size)."""
    return {n: {k: v.clone() for k, v in system.opt.state[p].items()}
            for n, p in system.model.named_parameters() if p in system.opt.state}


def _state_diff(a, b):
    if a.keys() != b.keys():
        return f"params with state differ: {sorted(a.keys() ^ b.keys())}"
    for n in a:
        if a[n].keys() != b[n].keys():
            return f"{n}: keys {sorted(a[n])} vs {sorted(b[n])}"
        if differ := [k for k in a[n] if not torch.equal(a[n][k], b[n][k])]:
            return f"{n}: {differ} differ"
    return None


def _torch_save(system, path):  # what an FSDP2 (or DDP) user writes
    msd, osd = get_state_dict(system.model, system.opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _torch_load(system, path):  # what an FSDP2 (or DDP) user runs to load
    msd, osd = get_state_dict(system.model, system.opt)
    # get_state_dict gives a fresh optimizer state for every trainable parameter, also those
    # that never got a gradient (UnevenMLP.unused), which no checkpoint holds, not even
    # FSDP2's own: without allow_partial_load, torch cannot load such a model's checkpoint.
    planner = DefaultLoadPlanner(allow_partial_load=True)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, planner=planner)
    set_state_dict(system.model, system.opt, model_state_dict=msd, optim_state_dict=osd)


# ---- resume is exact ----------------------------------------------------------------------

# Every stage with each optimizer on GPT (tied embeddings); UnevenMLP (frozen and unused
# parameters, which get no optimizer state) with both optimizers.
RESUME = [("gpt", o, k) for o in ("adamw", "sgd") for k in ("zero1", "zero2", "zero3")] + [
    ("mlp", "adamw", "zero3"), ("mlp", "sgd", "zero1")]


def _resume_first(rank, n, root, cases):
    out = {}
    for case in cases:
        s = _system(case[0], case[2], case[1])
        _train(s, rank, range(STEPS))
        state, full = _local_state(s), s.full_params()
        zero.save(os.path.join(root, "-".join(case)), s.model, s.opt)
        assert _state_diff(_local_state(s), state) is None, "saving changed the optimizer"
        assert first_difference(s.full_params(), full) is None, "saving changed the model"
        _train(s, rank, range(STEPS, 2 * STEPS))  # straight on to 6 steps
        out[case] = (state, s.full_params())
    return out


def _resume_second(rank, n, root, cases, first):
    failures = []
    for case in cases:
        s = _system(case[0], case[2], case[1], seed=1)  # other weights: all must come from disk
        zero.load(os.path.join(root, "-".join(case)), s.model, s.opt)
        if bad := _state_diff(_local_state(s), first[rank][case][0]):
            failures.append(f"{case}: optimizer state after load: {bad}")
        _train(s, rank, range(STEPS, 2 * STEPS))
        if bad := first_difference(s.full_params(), first[rank][case][1]):
            failures.append(f"{case}: after 3 + 3 steps: {bad}")
    return failures


def test_resume_is_bitwise_equal_to_straight_training(tmp_path):
    first = run_ranks(_resume_first, 2, str(tmp_path), RESUME)
    assert run_ranks(_resume_second, 2, str(tmp_path), RESUME, first) == [[], []]


def _scalars_save(rank, n, root):
    s = _system("scalars", "zero3", "adamw")
    _train(s, rank, range(STEPS))
    zero.save(root, s.model, s.opt)
    state, saved = _local_state(s), s.full_params()
    _train(s, rank, range(STEPS, 2 * STEPS))
    return state, saved, s.full_params()


def _scalars_load(rank, n, root, first):
    s = _system("scalars", "zero3", "adamw", seed=1)
    zero.load(root, s.model, s.opt)
    if n != len(first):  # resharded: the values must survive, the pieces are new
        return first_difference(s.full_params(), first[0][1])
    bad = _state_diff(_local_state(s), first[rank][0])
    _train(s, rank, range(STEPS, 2 * STEPS))
    return bad or first_difference(s.full_params(), first[rank][2])


def test_zero_dim_empty_and_one_element_parameters_round_trip(tmp_path):
    first = run_ranks(_scalars_save, 3, str(tmp_path))
    assert run_ranks(_scalars_load, 3, str(tmp_path), first) == [None] * 3  # resume, bitwise
    assert run_ranks(_scalars_load, 2, str(tmp_path), first) == [None] * 2  # 3 -> 2 ranks
    exported = zero.checkpoint.export(str(tmp_path), str(tmp_path / "scalars.pt"))
    assert exported["scale"].shape == () and exported["nothing"].shape == (0, 4)
    assert first_difference(exported, first[0][1]) is None


# ---- resharding: world size 2 <-> 3, stage 3 -> stage 1 ----------------------------------


def _reshard_save(rank, n, root, models):
    full = {}
    for model in models:
        s = _system(model, "zero3", "sgd")
        _train(s, rank, range(STEPS))
        zero.save(os.path.join(root, f"{model}-ws{n}"), s.model, s.opt)
        full[model] = s.full_params()
        _train(s, rank, range(STEPS, 2 * STEPS))
        full[model, "straight"] = s.full_params()
    return full


def _reshard_load(rank, n, root, models, saved_at, kind, saved):
    """Load one checkpoint into ours and into FSDP2 (by torch's own loader), check that the
    loaded values are the saved ones and FSDP2's layout, train on, report how far ours ends."""
    worst = {}
    for model in models:
        path = os.path.join(root, f"{model}-ws{saved_at}")
        s, fsdp2 = _system(model, kind, "sgd", seed=1), _system(model, "fsdp2", "sgd", seed=1)
        zero.load(path, s.model, s.opt)
        _torch_load(fsdp2, os.path.join(path, "latest"))
        assert first_difference(s.full_params(), saved[0][model]) is None, "load changed values"
        msd, osd = get_state_dict(fsdp2.model, fsdp2.opt)  # FSDP2's chunks at this world size
        ours = zero.checkpoint.state_dict(s.model, s.opt)
        # (torch's loader gave UnevenMLP.unused a fresh state that the checkpoint lacks)
        osd["state"] = {k: v for k, v in osd["state"].items() if k in ours["optim"]["state"]}
        assert _layout_diff(ours, {"model": msd, "optim": osd}) == []
        _train(s, rank, range(STEPS, 2 * STEPS))
        _train(fsdp2, rank, range(STEPS, 2 * STEPS))
        worst[model] = max_relative_difference(s.full_params(), fsdp2.full_params())
    return worst


def test_reshard_between_world_sizes_2_and_3_within_reduction_order_bound(tmp_path):
    root, models = str(tmp_path), ["gpt", "mlp"]
    two = run_ranks(_reshard_save, 2, root, models)
    three = run_ranks(_reshard_save, 3, root, models)
    up = run_ranks(_reshard_load, 3, root, models, 2, "zero1", two)[0]  # also stage 3 -> 1
    down = run_ranks(_reshard_load, 2, root, models, 3, "zero2", three)[0]
    assert max(up.values()) <= 1e-6, up
    assert max(down.values()) == 0.0, down  # world size 2 trains bitwise like FSDP2


def _stage_change(rank, n, root, straight):
    s = _system("gpt", "zero1", "sgd", seed=1)
    _train(s, rank, range(1))  # an optimizer that has state already: the checkpoint's replaces it
    zero.load(os.path.join(root, "gpt-ws2"), s.model, s.opt)  # saved by stage 3
    _train(s, rank, range(STEPS, 2 * STEPS))
    return first_difference(s.full_params(), straight[rank]["gpt", "straight"])


def test_stage_3_checkpoint_resumes_in_stage_1(tmp_path):
    straight = run_ranks(_reshard_save, 2, str(tmp_path), ["gpt"])
    assert run_ranks(_stage_change, 2, str(tmp_path), straight) == [None, None]


# ---- FSDP2: the same layout, and checkpoints that go both ways ----------------------------


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _kind(t):
    """Type, global shape, dtype, placements and local shape: the layout of one entry."""
    return (type(t).__name__, tuple(t.shape), t.dtype, getattr(t, "placements", None),
            tuple(_local(t).shape))


def _layout_diff(ours, theirs, path="") -> list[str]:
    """Where our state dict differs from FSDP2's ``get_state_dict``: keys, layouts, values
    (bitwise), param groups."""
    if isinstance(theirs, dict):
        if ours.keys() != theirs.keys():
            return [f"{path}: keys {sorted(map(str, ours.keys() ^ theirs.keys()))}"]
        return [d for k in theirs for d in _layout_diff(ours[k], theirs[k], f"{path}.{k}")]
    if not isinstance(theirs, torch.Tensor):
        return [] if ours == theirs else [f"{path}: {ours!r} vs {theirs!r}"]
    if _kind(ours) != _kind(theirs):
        return [f"{path}: ours {_kind(ours)}, FSDP2's {_kind(theirs)}"]
    return [] if torch.equal(_local(ours), _local(theirs)) else [f"{path}: values differ"]


def _interop_first(rank, n, root, models):
    out = {}
    for model in models:
        f, z = _system(model, "fsdp2", "adamw"), _system(model, "zero3", "adamw")
        _train(f, rank, range(STEPS))
        _train(z, rank, range(STEPS))
        msd, osd = get_state_dict(f.model, f.opt)
        layout = _layout_diff(zero.checkpoint.state_dict(z.model, z.opt), {"model": msd, "optim": osd})
        _torch_save(f, os.path.join(root, f"{model}-by-fsdp2"))
        zero.save(os.path.join(root, f"{model}-by-zero"), z.model, z.opt)
        _train(f, rank, range(STEPS, 2 * STEPS))
        _train(z, rank, range(STEPS, 2 * STEPS))
        out[model] = layout, f.full_params(), z.full_params()
    return out


INTEROP_STAGES = {"gpt": ("zero1", "zero3"), "mlp": ("zero2",)}


def _interop_second(rank, n, root, models, first):
    failures = []
    for model in models:
        _, fsdp2_straight, zero_straight = first[rank][model]
        for kind in INTEROP_STAGES[model]:  # FSDP2's checkpoint, into each stage once
            z = _system(model, kind, "adamw", seed=1)
            zero.load(os.path.join(root, f"{model}-by-fsdp2"), z.model, z.opt)
            _train(z, rank, range(STEPS, 2 * STEPS))
            if bad := first_difference(z.full_params(), fsdp2_straight):
                failures.append(f"{model}: FSDP2 -> {kind}: {bad}")
        f = _system(model, "fsdp2", "adamw", seed=1)  # ours, into FSDP2 by torch's own loader
        _torch_load(f, os.path.join(root, f"{model}-by-zero", "latest"))
        _train(f, rank, range(STEPS, 2 * STEPS))
        if bad := first_difference(f.full_params(), zero_straight):
            failures.append(f"{model}: zero3 -> FSDP2: {bad}")
    return failures


def _on_disk(path):
    meta = FileSystemReader(path).read_metadata()
    return {k: (type(m).__name__, getattr(m, "size", None),
                [(c.offsets, c.sizes) for c in getattr(m, "chunks", [])])
            for k, m in meta.state_dict_metadata.items()}


def test_fsdp2_interop_both_ways_is_bitwise(tmp_path):
    root, models = str(tmp_path), ["gpt", "mlp"]
    first = run_ranks(_interop_first, 2, root, models)
    for model in models:
        assert first[0][model][0] == [] and first[1][model][0] == []  # same dicts, bitwise
        # ... and the same files: every key, shape and chunk in .metadata
        assert _on_disk(os.path.join(root, f"{model}-by-zero", "latest")) == _on_disk(
            os.path.join(root, f"{model}-by-fsdp2"))
    assert run_ranks(_interop_second, 2, root, models, first) == [[], []]


# ---- atomic writes: a rank dies during a save ---------------------------------------------


def _save_one(rank, n, root, steps, with_optimizer=True):
    s = _system("gpt", "zero2", "adamw")
    _train(s, rank, range(steps))
    zero.save(root, s.model, s.opt if with_optimizer else None)
    return s.full_params()


def _die_during_save(rank, n, root, where):
    s = _system("gpt", "zero2", "adamw")
    _train(s, rank, range(2))
    if where == "data" and rank == 1:  # half its file written, then gone
        def write_data(self, plan, planner):
            with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                f.write(b"\0" * 100)
            os._exit(1)
        FileSystemWriter.write_data = write_data  # this forked rank only
    if where == "commit" and rank == 0:  # all data and .metadata written, not yet committed
        zero.checkpoint.directory.commit = lambda *args: os._exit(1)
    zero.save(root, s.model, s.opt)


def _load_full(rank, n, root, with_optimizer=True):
    s = _system("gpt", "zero2", "adamw", seed=1)
    zero.load(root, s.model, s.opt if with_optimizer else None)
    return s.full_params()


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    before = run_ranks(_save_one, 2, root, 1)  # v000001
    # Rank 1 dies half-way through its data (v000002); then rank 0 dies after every byte and
    # .metadata are written, just before the flip (v000003). Neither becomes "latest".
    for where, version in [("data", "v000002"), ("commit", "v000003")]:
        with pytest.raises(RankError):
            run_ranks(_die_during_save, 2, root, where)
        assert os.readlink(tmp_path / "latest") == "v000001"
        assert os.path.exists(tmp_path / version / ".metadata") == (where == "commit")
        assert first_difference(run_ranks(_load_full, 2, root)[0], before[0]) is None
    after = run_ranks(_save_one, 2, root, 2, False)  # skips the wrecks, then deletes them
    assert sorted(os.listdir(tmp_path)) == ["latest", "v000004"]
    assert first_difference(run_ranks(_load_full, 2, root, False)[0], after[0]) is None


# ---- errors: corrupt, truncated, another model --------------------------------------------


def _save_sgd(rank, n, root):
    s = _system("gpt", "zero3", "sgd")
    _train(s, rank, range(1))
    zero.save(root, s.model, s.opt)


def _errors(rank, n, root):
    messages = {}
    for name, build in [
        ("truncated", lambda: _system("gpt", "zero3", "sgd")),
        ("corrupt", lambda: _system("gpt", "zero3", "sgd")),
        ("good", lambda: System("zero3", GPT(GPTConfig(vocab=100, layers=3)), "sgd")),  # bigger
        ("good", lambda: _system("gpt", "zero3", "adamw")),  # another optimizer class
        ("nowhere", lambda: _system("gpt", "zero3", "sgd")),
    ]:
        s = build()
        with pytest.raises((RuntimeError, ValueError, FileNotFoundError)) as info:
            zero.load(os.path.join(root, name), s.model, s.opt)
        messages[len(messages)] = f"{info.type.__name__}: {info.value}"
    with pytest.raises(RuntimeError, match="holds a plain DCP checkpoint") as info:
        zero.save(os.path.join(root, "truncated"), s.model, s.opt)  # not a zero.save directory
    return messages


def test_corrupt_truncated_and_wrong_model_checkpoints_give_clear_errors(tmp_path):
    run_ranks(_save_sgd, 2, str(tmp_path / "good"))
    good = tmp_path / "good" / "latest"
    for name in ("truncated", "corrupt"):
        shutil.copytree(good, tmp_path / name)
    data = tmp_path / "truncated" / "__1_0.distcp"
    os.truncate(data, os.path.getsize(data) // 2)
    (tmp_path / "corrupt" / ".metadata").write_bytes(b"not a pickle")

    messages = run_ranks(_errors, 2, str(tmp_path))
    assert messages[0] == messages[1]  # every rank raises the same error, none hangs
    truncated, corrupt, model, optim, nowhere = messages[0].values()
    assert truncated.startswith("RuntimeError") and "truncated" in truncated
    assert "__1_0.distcp" in truncated and "model.head.weight" in truncated
    assert corrupt.startswith("RuntimeError") and ".metadata is corrupt" in corrupt
    assert model.startswith("ValueError")
    assert "model.blocks.2.ln1.weight (32,)" in model  # missing from the checkpoint
    assert "model.tok_emb.weight: checkpoint (96, 32), model (100, 32)" in model
    assert optim.startswith("ValueError") and "['dampening', 'momentum', 'nesterov']" in optim
    assert nowhere.startswith("FileNotFoundError")


def _seen_by_rank0_only(rank, n, root):
    s = _system("gpt", "zero3", "sgd", seed=1)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as info:  # rank 1's disk lacks it (node-local disks)
        zero.load(root if rank == 0 else os.path.join(root, "elsewhere"), s.model, s.opt)
    return str(info.value), time.monotonic() - start


def test_a_checkpoint_missing_on_one_rank_raises_on_every_rank_at_once(tmp_path):
    """The ranks agree on the checks' outcome before any collective: rank 0, which sees the
    checkpoint, must not wait for rank 1 in dcp.load forever."""
    run_ranks(_save_sgd, 2, str(tmp_path))
    (first, t0), (second, t1) = run_ranks(_seen_by_rank0_only, 2, str(tmp_path), timeout=20)
    assert first.startswith(f"rank 1 cannot load {tmp_path}: no checkpoint at {tmp_path}/elsewhere")
    assert second.startswith(f"no checkpoint at {tmp_path}/elsewhere")
    assert max(t0, t1) < 5, (t0, t1)


# ---- the consolidated export ---------------------------------------------------------------


def test_export_loads_into_a_plain_model_and_the_command_line_writes_the_same(tmp_path):
    full = run_ranks(_save_one, 2, str(tmp_path / "ckpt"), 2)[0]  # zero.full_state_dict
    state = zero.checkpoint.export(str(tmp_path / "ckpt"), str(tmp_path / "model.pt"))
    plain = GPT()  # one process, no process group, not sharded
    exported = torch.load(tmp_path / "model.pt", weights_only=True)  # tensors only: no code
    plain.load_state_dict(exported)  # strict: every key, every shape
    assert first_difference({n: p.detach() for n, p in plain.named_parameters()}, full) is None

    cli = [sys.executable, "-m", "zero", "export", str(tmp_path / "ckpt"),
           str(tmp_path / "cli.pt")]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=os.path.dirname(zero.__path__[0]))
    assert done.returncode == 0 and done.stderr == "" and "wrote" in done.stdout, done.stderr
    assert first_difference(torch.load(tmp_path / "cli.pt", weights_only=True), state) is None


def _save_without_model(rank, n, path):
    dcp.save({"weights": {"w": torch.ones(4)}, "step": torch.tensor(3)}, checkpoint_id=path)


def test_export_of_a_checkpoint_without_a_model_names_what_is_missing(tmp_path):
    run_ranks(_save_without_model, 2, str(tmp_path / "ckpt"))
    cli = [sys.executable, "-m", "zero", "export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=os.path.dirname(zero.__path__[0]))
    assert done.returncode == 1, done.stdout
    assert "holds no 'model' entry (its top-level keys: step; weights)" in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "out.pt")


def _before_first_step(rank, n, root):
    s = _system("gpt", "zero3", "adamw")
    zero.save(root, s.model, s.opt)  # the optimizer has no state yet: param groups only
    z = _system("gpt", "zero1", "adamw", seed=1)
    _train(z, rank, range(1))
    zero.load(root, z.model, z.opt)
    empty = len(z.opt.state) == 0
    _train(s, rank, range(2))
    _train(z, rank, range(2))
    return empty, first_difference(z.full_params(), s.full_params())


def test_checkpoint_saved_before_the_first_step(tmp_path):
    assert run_ranks(_before_first_step, 2, str(tmp_path)) == [(True, None)] * 2
