"""Checkpoints (zero/checkpoint/dcp.py): exact resume, resharding, FSDP2 both ways, atomicity, errors.

Every "bitwise" below is ``torch.equal``. A resume runs in fresh ranks, from a model built with
another seed, so everything it gets right came from the checkpoint.
"""

import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
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
from conftest import FULL
from harness import RankError, run_main, run_ranks
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
if not FULL:  # the suite's sample: every stage once, both optimizers, both models
    RESUME = [("gpt", "adamw", "zero1"), ("gpt", "adamw", "zero2"), ("gpt", "sgd", "zero3"),
              ("mlp", "sgd", "zero1")]


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
    root, models = str(tmp_path), ["gpt", "mlp"] if FULL else ["gpt"]  # (ZERO_FULL=1: both)
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
    root, models = str(tmp_path), ["gpt", "mlp"] if FULL else ["gpt"]  # (ZERO_FULL=1: both)
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
    # Rank 1 dies half-way through its data; then rank 0 dies after every byte and .metadata
    # are written, just before the flip. Neither becomes "latest". (Whether rank 0 deleted the
    # first wreck before the harness killed it is a race, so the versions are not numbered.)
    def complete_wrecks():
        return [d for d in os.listdir(tmp_path) if d.startswith("v") and d != "v000001"
                and os.path.exists(tmp_path / d / ".metadata")]

    for where in ("data", "commit"):
        with pytest.raises(RankError):
            run_ranks(_die_during_save, 2, root, where)
        assert os.readlink(tmp_path / "latest") == "v000001"
        assert len(complete_wrecks()) == (where == "commit"), os.listdir(tmp_path)
        assert first_difference(run_ranks(_load_full, 2, root)[0], before[0]) is None
    after = run_ranks(_save_one, 2, root, 2, False)  # skips the wrecks, then deletes them
    latest = os.readlink(tmp_path / "latest")
    assert latest > "v000002" and sorted(os.listdir(tmp_path)) == ["latest", latest]
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

    done = run_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli.pt")])
    assert done.returncode == 0 and done.stderr == "" and "wrote" in done.stdout, done.stderr
    assert first_difference(torch.load(tmp_path / "cli.pt", weights_only=True), state) is None


def _save_without_model(rank, n, path):
    dcp.save({"weights": {"w": torch.ones(4)}, "step": torch.tensor(3)}, checkpoint_id=path)


def test_export_of_a_checkpoint_without_a_model_names_what_is_missing(tmp_path):
    run_ranks(_save_without_model, 2, str(tmp_path / "ckpt"))
    done = run_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")])
    assert done.returncode == 1, done.stdout
    assert "holds no 'model' entry (its top-level keys: step; weights)" in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "out.pt")


def _titan_layout(rank, n, path):
    """A checkpoint laid out as torchtitan's CheckpointManager writes one (the model's entries
    at the top level, the optimizer's flattened under "optimizer"), then zero.load of it."""
    s = _system("gpt", "zero3", "adamw")
    plain = {k: v.detach().clone() for k, v in s.full_params().items()}
    dcp.save({**plain, "optimizer": {f"state.{k}.exp_avg": torch.zeros_like(v) for k, v in plain.items()}},
             checkpoint_id=path)
    try:
        zero.load(path, s.model, s.opt)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_a_torchtitan_layout_is_refused_naming_the_way_that_loads_it(tmp_path):
    said = run_ranks(_titan_layout, 2, str(tmp_path / "ckpt"))
    assert said[0] == said[1] and "torchtitan's CheckpointManager" in said[0], said[0]
    assert "zero.fully_shard" in said[0] and "blocks.0.fc.weight" in said[0], said[0]


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


# ---- a load beside a save: one version, whatever the save does ---------------------------


def _save_mlp(rank, n, root, steps):
    s = _system("mlp", "zero3", "adamw")
    _train(s, rank, range(steps))
    zero.save(root, s.model, s.opt)
    return s.full_params()


def _two_versions(tmp_path, name):
    """``name``/v000001 and v000002 (one and two AdamW steps), ``latest`` -> v000001."""
    root = tmp_path / name
    root.mkdir()
    for v, src in (("v000001", "one"), ("v000002", "two")):
        shutil.copytree(tmp_path / src / "latest", root / v)
    os.symlink("v000001", root / "latest")
    return str(root)


def _flip(root, delete):
    """What a save does at its commit: ``latest`` to v000002, then (keep=1) v000001 deleted."""
    os.symlink("v000002", os.path.join(root, "latest.tmp"))
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    if delete:
        shutil.rmtree(os.path.join(root, "v000001"))


def _racing(rank, n, roots):
    """Load while a save flips ``latest`` (rank 0, between two barriers): after the ranks read
    .metadata, and with or without deleting the old version; or once the data is being read."""
    import zero.checkpoint.reader as reader
    import zero.checkpoint.safe_pickle as safe_pickle

    out = {}
    for case, root in roots.items():
        def race():
            dist.barrier()
            if rank == 0:
                _flip(root, delete=case != "flip")
            dist.barrier()
        hooked = {}  # (fires once per case)
        if case == "delete once reading":
            original = reader.Reader.read_data
            def read_data(self, *args):
                if not hooked:
                    hooked[1] = race()
                return original(self, *args)
            reader.Reader.read_data = read_data
        else:
            original = safe_pickle.load_metadata
            def load_metadata(*args):
                meta = original(*args)
                if not hooked:
                    hooked[1] = race()
                return meta
            safe_pickle.load_metadata = load_metadata
        s = _system("mlp", "zero3", "adamw", seed=1)
        try:
            zero.load(root, s.model, s.opt)
            out[case] = s.full_params()
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            out[case] = f"{type(e).__name__}: {e}"
        finally:
            if case == "delete once reading":
                reader.Reader.read_data = original
            else:
                safe_pickle.load_metadata = original
    return out


def test_a_load_reads_the_version_it_resolved_while_a_save_flips_latest(tmp_path, monkeypatch):
    """A save that moves ``latest`` between the reads of one load must not mix two versions:
    the load reads the version it resolved, or (deleted before it opened its files) raises."""
    one = run_ranks(_save_mlp, 2, str(tmp_path / "one"), 1)[0]
    run_ranks(_save_mlp, 2, str(tmp_path / "two"), 2)
    cases = ("flip", "flip and delete", "delete once reading")
    roots = {case: _two_versions(tmp_path, f"race{i}") for i, case in enumerate(cases)}
    for rank, got in enumerate(run_ranks(_racing, 2, roots, timeout=30)):
        assert isinstance(got["flip"], dict), got["flip"]
        assert first_difference(got["flip"], one) is None, "read v000002's data for v000001"
        assert isinstance(got["delete once reading"], dict), got["delete once reading"]
        assert first_difference(got["delete once reading"], one) is None
        deleted = got["flip and delete"]
        assert isinstance(deleted, str) and deleted.startswith("FileNotFoundError"), deleted
        assert "v000001 no longer exists: it was deleted while it was being read" in deleted
    # export, in this process: the same flip after it read .metadata
    import zero.checkpoint.safe_pickle as safe_pickle
    root, original = _two_versions(tmp_path, "race-export"), safe_pickle.load_metadata
    monkeypatch.setattr(safe_pickle, "load_metadata",
                        lambda *a: (original(*a), _flip(root, delete=False))[0])
    exported = zero.checkpoint.export(root, str(tmp_path / "out.pt"))
    assert first_difference(exported, one) is None


# ---- which versions a save deletes: only its own, the oldest beyond keep ---------------------


def _saves(rank, n, root, keeps):
    """One save per entry of ``keeps`` (None: the default); what rank 0's deletions saw."""
    import zero.checkpoint.directory as ckdir

    s = _system("mlp", "zero3", "sgd")
    seen, delete = [], getattr(ckdir, "delete_version", None)
    def recording(path, version):  # where latest points as each deletion starts
        seen.append((version, os.readlink(os.path.join(root, "latest"))))
        return delete(path, version)
    ckdir.delete_version = recording
    listings = []
    for keep in keeps:
        written = zero.save(root, s.model, s.opt, **({} if keep is None else {"keep": keep}))
        listings.append((os.path.basename(written), sorted(os.listdir(root))))
    return listings, seen


def test_save_deletes_only_its_own_versions_and_keeps_the_last_k(tmp_path):
    root = tmp_path / "ckpt"
    users = ["v000002", "v1", "v10"]  # the user's own directories, named like versions
    for user in users:
        (root / user).mkdir(parents=True)
        (root / user / "notes.txt").write_text("mine")
    first, _ = run_ranks(_saves, 2, str(root), [None])[0]  # keep=1, the default
    assert first == [("v000011", sorted(["latest", *users, "v000011"]))]  # past every number
    listings, seen = run_ranks(_saves, 2, str(root), [3, 3, 3, 2])[0]
    assert listings == [(new, sorted(["latest", *users, *ours])) for new, ours in [
        ("v000012", ["v000011", "v000012"]),
        ("v000013", ["v000011", "v000012", "v000013"]),
        ("v000014", ["v000012", "v000013", "v000014"]),
        ("v000015", ["v000014", "v000015"])]]
    assert all((root / user / "notes.txt").read_text() == "mine" for user in users)
    # each deletion came after the flip to the version just written
    assert seen == [("v000011", "v000014"), ("v000012", "v000015"), ("v000013", "v000015")]


# ---- what a load allocates: this rank's shards and one unit, not the model -----------------

PEAK_GPT = GPTConfig()  # (notes/figures/checkpoint_costs.py measures a larger one, at 2 and 4 ranks)


def _save_gpt(rank, n, root):
    torch.manual_seed(0)
    s = System("zero3", GPT(PEAK_GPT), "adamw")
    _train(s, rank, range(1))
    zero.save(root, s.model, s.opt)


def _load_peak(rank, n, root):
    """Peak bytes of the tensors zero.load allocates on this rank (torch's MemTracker, on a
    fresh model and optimizer, less what they held before), against this rank's shards
    (parameters, exp_avg, exp_avg_sq) and the largest unit whole."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(1)
    s = System("zero3", GPT(PEAK_GPT), "adamw")
    units = zero.units_of(s.model)
    tracker, cpu = MemTracker(), torch.device("cpu")
    tracker.track_external(s.model, s.opt)  # (an in-place copy into them is no allocation)
    with tracker:
        before = tracker.get_tracker_snapshot()[cpu]["Total"]
        zero.load(root, s.model, s.opt)
    peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before
    shards = 4 * 3 * sum(u.layout.shard_numel for u in units)
    return peak, shards, 4 * max(u.layout.padded_numel for u in units)


def test_a_load_allocates_this_ranks_shards_and_one_unit(tmp_path):
    run_ranks(_save_gpt, 2, str(tmp_path))
    for n in (2, 3):  # the same world size, and resharded
        for rank, (peak, shards, unit) in enumerate(run_ranks(_load_peak, n, str(tmp_path))):
            print(f"N = {n}, rank {rank}: peak {peak:,} B, shards {shards:,} + one unit {unit:,}")
            assert peak <= shards + unit, (n, rank, peak, shards, unit)


# ---- saving: the optimizer, a failed save, two jobs --------------------------------------------


def _save_with_odd_optimizers(rank, n, root):
    """zero.save with an optimizer that holds a parameter outside the model, and with one
    built before zero.shard: what each raised, on this rank."""
    torch.manual_seed(0)
    base = MODELS["mlp"]()
    early = torch.optim.SGD(base.parameters(), lr=0.1)  # built on the parameters shard replaces
    s = System("zero3", base, "sgd")  # (System shards a copy: build one on this model itself)
    for unit in base.units():
        zero.shard(unit, stage=3)
    outside = torch.optim.SGD([*s.model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    out = {}
    for name, model, opt in (("outside", s.model, outside), ("before shard", base, early)):
        try:
            zero.save(os.path.join(root, name.replace(" ", "-")), model, opt)
            out[name] = "saved"
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_saving_an_optimizer_that_does_not_hold_the_models_parameters_names_the_fix(tmp_path):
    for got in run_ranks(_save_with_odd_optimizers, 2, str(tmp_path)):
        assert got["outside"].startswith("ValueError: SGD holds a parameter of shape (3,) that "
                                         "is not one of the model's"), got["outside"]
        assert "Build the optimizer on model.parameters()" in got["outside"]
        assert got["before shard"].startswith("ValueError: SGD holds a parameter that zero.shard "
                                              "replaced"), got["before shard"]
        assert "Build it after zero.shard" in got["before shard"]
    assert not os.listdir(tmp_path)  # nothing was written


def _save_failing_on_rank1(rank, n, root):
    """zero.save where rank 1's disk is full as it writes its data."""
    s = _system("mlp", "zero3", "sgd")
    zero.save(root, s.model, s.opt)  # v000001
    if rank == 1:
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")
        FileSystemWriter.write_data = write_data  # this forked rank only
    try:
        zero.save(root, s.model, s.opt)
        return "saved"
    except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        return type(e).__name__


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    """A full disk fails every rank's save; its partial version goes at once (else every
    save after it finds the disk as full); ``latest`` stays on the last good one."""
    got = run_ranks(_save_failing_on_rank1, 2, str(tmp_path))
    assert "saved" not in got, got
    assert sorted(os.listdir(tmp_path)) == ["latest", "v000001"]
    assert os.readlink(tmp_path / "latest") == "v000001"


def _save_paused(rank, n, root, gate):
    """zero.save whose ranks wait, in the middle of writing, until ``gate`` exists."""
    s = _system("mlp", "zero3", "sgd")
    write = FileSystemWriter.write_data
    def paused(self, plan, planner):
        open(f"{gate}.{rank}", "w").close()
        while not os.path.exists(gate):
            time.sleep(0.02)
        return write(self, plan, planner)
    FileSystemWriter.write_data = paused
    return os.getpid(), zero.save(root, s.model, s.opt)


def _save_or_error(rank, n, root):
    s = _system("mlp", "zero3", "sgd")
    try:
        return zero.save(root, s.model, s.opt)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _first_job(results, root, gate):
    try:
        results.put(run_ranks(_save_paused, 2, root, gate))
    except BaseException as e:  # noqa: BLE001 (the test reports it)
        results.put(f"{type(e).__name__}: {e}"[:2000])


def test_a_second_job_saving_into_the_same_directory_is_refused_naming_the_first(tmp_path):
    """Two jobs saving into one directory would take the same version number, or delete each
    other's versions as they write them: the second is refused while the first saves."""
    import multiprocessing as mp
    root, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    first = ctx.Process(target=_first_job, args=(results, root, gate))
    first.start()
    try:
        deadline = time.monotonic() + 30
        while not all(os.path.exists(f"{gate}.{r}") for r in range(2)):
            assert time.monotonic() < deadline and first.is_alive(), "the first job never wrote"
            time.sleep(0.02)
        second = run_ranks(_save_or_error, 2, root)  # while the first one writes
    finally:
        open(gate, "w").close()
        got = results.get(timeout=60)
        first.join(30)
    assert not isinstance(got, str), got
    (pid, written), _ = got
    for message in second:
        assert message.startswith("RuntimeError: rank 0 could not start a new version in the "
                                  f"checkpoint directory: RuntimeError: another job is saving into "
                                  f"{root} (pid {pid} on "), message
    assert written == os.path.join(root, "v000001")
    assert os.readlink(os.path.join(root, "latest")) == "v000001"
    assert sorted(os.listdir(root)) == ["latest", "v000001"]


# ---- export: where it writes ---------------------------------------------------------------


def test_export_refuses_a_directory_or_the_checkpoints_own_files_before_writing(tmp_path):
    run_ranks(_save_one, 2, str(tmp_path / "ckpt"), 1)
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="is a directory: give export the name of the file"):
        zero.checkpoint.export(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == [] and not list(tmp_path.glob("*.tmp"))
    version = tmp_path / "ckpt" / "v000001"
    files = {f: (version / f).read_bytes() for f in os.listdir(version)}
    for target in (version / "__0_0.distcp", tmp_path / "ckpt" / "latest" / "model.pt",
                   tmp_path / "ckpt" / "latest"):
        with pytest.raises(ValueError, match="is a file of the checkpoint .* itself"):
            zero.checkpoint.export(str(tmp_path / "ckpt"), str(target))
    assert {f: (version / f).read_bytes() for f in os.listdir(version)} == files
    assert os.readlink(tmp_path / "ckpt" / "latest") == "v000001"
