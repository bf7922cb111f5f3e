"""The seams of zero/api.py, used as a reader would use them: each change is one argument or
one object, and what it changes is measured (tests/core/test_seam_toys.py writes one object
for each seam from zero/api.py alone).

- prefetch depth 2: ``zero.shard(root, prefetch=2)``; the ledger shows two units gathered
  ahead of the one computing, and the measured model-state peak is the bench's memory model
  (which asks the mechanism's own ``Schedule``) to the byte;
- a logging backend: ``zero.shard(..., backend=LoggingBackend(path))``; every collective of a
  training step and of ``zero.save`` is in its file;
- an object that is not what a seam needs is refused by ``zero.shard``, naming how it differs
  (members and signatures);
- one context per root: what the root's call is given reaches every unit, what a unit below
  is given differently is refused; the collectives run on the context's streams;
- the package's shape (benchmarks/shape.py): no module-level mutable state, no upward import.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed._tools.mem_tracker import _MemRefType  # noqa: F401 (MemTracker's kinds)
from torch.optim.optimizer import _global_optimizer_pre_hooks

import zero
from conftest import sample
from harness import run_ranks
from zero.features.logging_backend import LoggingBackend
from zero.surface.attach import discover
from zerolab.memory import schedule
from zerolab.models import GPT, GPTConfig
from zerolab.trackers import MODEL_STATES, ZeroMemTracker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpt(stage, layers=4, prefetch=1, root_only=False, **kw):
    """A GPT sharded unit by unit; ``prefetch`` (and with ``root_only`` every ``kw``) given
    to the root's call only, as the root's to give."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, dim=32, vocab=64, seq=8))
    for unit in model.units():
        root = unit is model
        zero.shard(unit, stage=stage, prefetch=prefetch if root else None,
                   **(kw if root or not root_only else {}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, rank, s=0):
    x, y = model.batch(2, torch.Generator().manual_seed(10 * s + rank))
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# ---- prefetch depth: one argument ------------------------------------------------------------


def _forward_order(rank, n, prefetch):
    model, opt = _gpt(3, prefetch=prefetch)
    _step(model, opt, rank)  # the schedule learns the order from this iteration
    events = []
    for name, m in [("root", model), *[(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]]:
        m.register_forward_pre_hook(lambda m, a, name=name: events.append(f"forward {name}"))
    on_record = lambda r: events.append(f"gather {r.unit}") if (  # noqa: E731
        r.op == "all_gather" and r.phase == "forward") else None
    with zero.Ledger(on_record=on_record):
        _step(model, opt, rank, 1)
    return [e for e in events if e.startswith(("forward", "gather"))][:10]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_depth_is_one_argument_and_the_ledger_shows_it(prefetch):
    events = run_ranks(_forward_order, 2, prefetch)[0]
    # When a block starts its forward, the next `prefetch` blocks' all-gathers were issued.
    for i in range(4):
        start = events.index(f"forward blocks.{i}")
        issued = {e.split()[1] for e in events[:start] if e.startswith("gather")}
        ahead = {f"blocks.{j}" for j in range(i + 1, min(4, i + 1 + prefetch))}
        beyond = {f"blocks.{j}" for j in range(i + 1 + prefetch, 4)}
        assert ahead <= issued and not beyond & issued, (i, events)


def _peak(rank, n, prefetch):
    model, opt = _gpt(3, layers=6, prefetch=prefetch)
    _step(model, opt, rank)
    with ZeroMemTracker(model, opt) as mt:
        _step(model, opt, rank, 1)
    units = zero.units_of(model)
    predicted = schedule([u.layout.padded_numel for u in units], 3, n,
                         sum(len(u.params) for u in units), prefetch=prefetch)
    return mt.category_peaks[torch.device("cpu")][MODEL_STATES], predicted["peak"]


def test_prefetch_two_ahead_holds_what_the_memory_model_says_to_the_byte():
    one = run_ranks(_peak, 2, 1)
    two = run_ranks(_peak, 2, 2)
    for (measured, predicted) in one + two:
        assert measured == predicted, (measured, predicted)
    assert two[0][0] > one[0][0]  # one more unit gathered at once


# ---- a logging backend: one new file, one argument ---------------------------------------------


def _logged(rank, n, directory):
    path = os.path.join(directory, f"rank{rank}.log")
    model, opt = _gpt(3, layers=2, backend=LoggingBackend(path))
    open(path, "w").close()  # (zero.shard's own agreements are logged too: start afresh)
    with zero.Ledger() as step:
        _step(model, opt, rank)
    after_step = open(path).read().splitlines()
    with zero.Ledger() as save:
        zero.save(os.path.join(directory, "ckpt"), model, opt)
    after_save = open(path).read().splitlines()[len(after_step):]
    ops = lambda ledger: [("all_gather" if r.op == "agree" else r.op)  # noqa: E731
                          for r in ledger.records if r.sent_bytes or r.op == "agree"]
    return ops(step), after_step, ops(save), after_save


def test_a_logging_backend_sees_every_collective_of_a_step_and_of_a_save(tmp_path):
    for step, step_log, save, save_log in run_ranks(_logged, 2, str(tmp_path)):
        logged = [line.split()[0].split("(")[0] for line in step_log]
        assert logged == step and len(step) >= 8  # every collective of the step, in order
        logged = [line.split()[0].split("(")[0] for line in save_log]
        it = iter(logged)
        assert all(op in it for op in save)  # the ledger's, in order, among the logged ones
        extra = len(logged) - len(save)  # small objects between ranks, not in the ledger
        assert extra >= 0 and all(op == "all_gather" for op in logged if op not in save)


# ---- an object that is not what a seam needs: checked by signature -----------------------------


class _NoReduce:
    in_place_ok = True

    def all_gather(self, *args, **kwargs):
        raise AssertionError("never called")


class _NoCtx:
    """``CommPolicy``'s methods as they were documented before the mechanism passed ``ctx``."""

    in_place_ok = True

    def all_gather(self, full, shard, slot, *, in_place, group, unit, phase):
        raise AssertionError("never called")

    def reduce_scatter(self, grad, slot, *, op, group, unit, phase):
        raise AssertionError("never called")

    def all_reduce(self, tensor, *, op, group, unit, phase):
        raise AssertionError("never called")


def _refused(rank, n, what):
    from zero.comm.backend import TorchBackend

    kw = {"comm": {"comm_policy": _NoReduce()}, "backend": {"backend": object()},
          "ctx": {"comm_policy": _NoCtx()}, "class": {"backend": TorchBackend},
          "offload": {"offload_policy": object()}}[what]
    try:
        zero.shard(torch.nn.Linear(4, 4), stage=3, **kw)
    except TypeError as e:
        return str(e)
    return "sharded"


@pytest.mark.parametrize("what,says", [
    ("comm", "lacks the method 'reduce_scatter'; it lacks the method 'all_reduce'"),
    ("backend", "lacks the method 'rank'"),
    ("ctx", "all_gather: it takes no keyword argument 'ctx'"),
    ("class", "backend is the class TorchBackend, not an object: give an instance"),
    ("offload", "lacks 'on_device'")])
def test_shard_names_how_a_seam_object_differs_by_signature(what, says):
    for message in run_ranks(_refused, 2, what):
        assert says in message and ("zero/api.py" in message or what == "class"), message


def test_an_offload_policy_need_not_subclass_zeros():
    """offload_from_torch converts torch's policies and leaves any other object to the
    protocol check (it once refused a complete policy for not being zero's)."""
    from toys.offload import HostOptimizerState

    from zero.features.offload import OnDevice, offload_from_torch
    from torch.distributed.fsdp import OffloadPolicy

    policy = HostOptimizerState()
    assert offload_from_torch(policy) is policy
    assert offload_from_torch(OffloadPolicy()) == OnDevice()


# ---- one context per root ------------------------------------------------------------------------


def _one_context(rank, n, tmp):
    backend = LoggingBackend(os.path.join(tmp, f"rank{rank}.log"))
    model, opt = _gpt(3, layers=3, backend=backend, root_only=True)
    units = zero.units_of(model)
    roots = {id(u.root) for u in units}
    contexts = {id(u.root.context) for u in units}
    watches = sum(h is discover for h in _global_optimizer_pre_hooks.values())  # (a process's)
    open(backend.path, "w").close()
    with zero.Ledger() as ledger:
        _step(model, opt, rank)
    logged = open(backend.path).read().splitlines()
    return len(units), watches, len(roots), len(contexts), len(logged), len(ledger.records)


def test_one_context_per_root_carries_every_collective_of_every_unit(tmp_path):
    """A model sharded in 4 calls has one root and one context, and the process one
    optimizer watch; the backend given to the root's call carries every collective of every
    unit (it once carried 6 of a step's 8 all-gathers, the rest going through
    torch.distributed unseen)."""
    for units, watches, roots, contexts, logged, recorded in run_ranks(_one_context, 2,
                                                                     str(tmp_path)):
        assert (units, watches, roots, contexts) == (4, 1, 1, 1)
        assert logged == recorded > 8


def _given_below(rank, n, what, same):
    given = {"backend": LoggingBackend(os.devnull), "prefetch": 2}[what]
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, dim=16, vocab=32, seq=8))
    try:
        for block in model.blocks:
            zero.shard(block, stage=3, **{what: given})
        zero.shard(model, stage=3, **({what: given} if same else {}))
    except ValueError as e:
        return str(e)
    return "sharded"


@pytest.mark.parametrize("what", ["backend", "prefetch"])
def test_what_a_unit_below_is_given_is_the_roots_or_refused(what):
    for message in run_ranks(_given_below, 2, what, True):
        assert message == "sharded"  # the same object at every call: FSDP1's auto-wrap does so
    for message in run_ranks(_given_below, 2, what, False):
        assert f"{what} is the root's to give" in message and "root's zero.shard" in message


class _Plain:
    """A schedule with Python's default repr (its address)."""

    def forward_prefetch(self, unit, order):
        return []

    def backward_prefetch(self, unit, order):
        return []


def _alike_below(rank, n):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, dim=16, vocab=32, seq=8))
    try:
        for block in model.blocks:
            zero.shard(block, stage=3, schedule=_Plain())
        zero.shard(model, stage=3, schedule=_Plain())
    except ValueError as e:
        return str(e)
    return "sharded"


def test_a_conflict_between_two_objects_alike_says_so_without_addresses():
    for message in run_ranks(_alike_below, 2):
        assert "schedule=test_seams._Plain()" in message and "0x" not in message, message
        assert "another _Plain object, alike but not the same" in message


class _Blocking:
    """A backend whose collectives finish before they return, and return None (as FSDP2's
    comm objects may): written from zero/api.py, torch.distributed underneath."""

    def __init__(self):
        from zero.comm.backend import TorchBackend
        self.inner = TorchBackend()

    def __repr__(self):
        return "_Blocking()"

    def rank(self, group=None):
        return self.inner.rank(group)

    def world_size(self, group=None):
        return self.inner.world_size(group)

    def name(self, group=None):
        return self.inner.name(group)

    def world(self):
        return self.inner.world()

    def global_rank(self, group, group_rank):
        return self.inner.global_rank(group, group_rank)

    def default_device(self, group=None):
        return self.inner.default_device(group)

    def bounded_wait(self, group, op):
        return self.inner.bounded_wait(group, op)

    def all_gather(self, output, input, group, async_op):
        self.inner.all_gather(output, input, group, async_op=False)

    def reduce_scatter(self, output, input, op, group, async_op):
        self.inner.reduce_scatter(output, input, op, group, async_op=False)

    def all_to_all(self, output, input, group, async_op):
        self.inner.all_to_all(output, input, group, async_op=False)

    def all_reduce(self, tensor, op, group, async_op):
        self.inner.all_reduce(tensor, op, group, async_op=False)

    def broadcast(self, tensor, src, group, async_op):
        self.inner.broadcast(tensor, src, group, async_op=False)


def _blocking(rank, n, backend):
    model, opt = _gpt(3, layers=2, backend=_Blocking() if backend else None, root_only=True)
    for s in range(2):
        _step(model, opt, rank, s)
    return zero.full_state_dict(model)


def test_a_backend_whose_collectives_return_none_trains_like_the_default():
    for ours, default in zip(run_ranks(_blocking, 2, True), run_ranks(_blocking, 2, False)):
        assert all(torch.equal(ours[k], default[k]) for k in default)


# ---- streams: the context's, in FSDP2's order --------------------------------------------------


class _Recorder:
    """A device module whose streams record what waits on what (torch.cpu's do nothing)."""

    def __init__(self, log):
        self.log, self.now, outer = log, None, self

        class Stream:
            def __init__(self, name=None, priority=0):
                self.name = name or f"s{len(log)}"
                log.append(f"{self.name} made with priority {priority}")

            def wait_stream(self, other):
                log.append(f"{self.name} waits {other.name}")

            def wait_event(self, event):
                log.append(f"{self.name} waits event {event}")

            def record_event(self):
                log.append(f"{self.name} records e{len(log)}")
                return f"e{len(log) - 1}"

        self.Stream = Stream
        self.current = Stream("compute")

    def current_stream(self):
        return self.now or self.current

    def stream(self, stream):
        import contextlib

        @contextlib.contextmanager
        def on():
            before, self.now = self.now, stream
            try:
                yield
            finally:
                self.now = before
        return on()


def _streams(rank, n):
    log = []
    recorder = _Recorder(log)
    real = torch.get_device_module
    torch.get_device_module = lambda device=None: recorder  # (this rank's process only)
    try:
        model, opt = _gpt(3, layers=2)
        _step(model, opt, rank)
        streams = zero.units_of(model)[0].root.context.streams(torch.device("cpu"))
        names = {streams.copy_in: "copy_in", streams.all_gather: "all_gather",
                 streams.reduce_scatter: "reduce_scatter", streams.all_reduce: "all_reduce"}
        made = [line for line in log if " made with priority " in line]
        for s, name in names.items():
            s.name = name
        log.clear()
        log += made
        _step(model, opt, rank, 1)
    finally:
        torch.get_device_module = real
    return log


def test_collectives_run_on_the_contexts_streams_in_fsdp2s_order():
    """Each all-gather: the copy-in stream waits for the computation, the all-gather stream
    for the copy-in, and the computation for the gather's event before it reads; each
    reduce-scatter: its stream waits for the computation, which waits for its event. The four
    side streams are made with FSDP2's high priority (-1)."""
    log = run_ranks(_streams, 2)[0]
    gathers = [i for i, line in enumerate(log) if line.startswith("all_gather records")]
    reduces = [i for i, line in enumerate(log) if line.startswith("reduce_scatter records")]
    assert len(gathers) >= 3 and len(reduces) >= 3, log
    made = [line for line in log if " made with priority " in line and "compute" not in line]
    assert len(made) == 4 and all(line.endswith("priority -1") for line in made), made
    for i in gathers:
        event = log[i].split()[-1]
        assert log[i - 3 : i] == ["copy_in waits compute", "all_gather waits copy_in",
                                  "all_gather waits compute"], log[i - 3 : i]
        assert f"compute waits event {event}" in log[i:], event
    for i in reduces:
        event = log[i].split()[-1]
        assert log[i - 1] == "reduce_scatter waits compute"
        assert f"compute waits event {event}" in log[i:], event


class _PlainCollectives:
    """A comm policy written from zero/api.py alone, with Python's default repr (which holds
    its address: different on every rank)."""

    in_place_ok = True

    def __init__(self, block: int):
        from zero.comm.flat_collectives import FlatCollectives

        self.block, self.inner = block, FlatCollectives()

    def all_gather(self, *args, **kwargs):
        return self.inner.all_gather(*args, **kwargs)

    def reduce_scatter(self, *args, **kwargs):
        return self.inner.reduce_scatter(*args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        return self.inner.all_reduce(*args, **kwargs)


def _plain_policy(rank, n, blocks):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    try:
        zero.shard(model, stage=3, comm_policy=_PlainCollectives(blocks[rank]))
    except ValueError as e:
        return str(e)
    model(torch.ones(2, 4)).sum().backward()
    return "trained"


def test_a_policy_with_pythons_default_repr_is_described_by_its_fields():
    """Every rank built the same policy, and zero.shard said "Ranks shard different modules:
    comm_policy differs" (rank 0: <...object at 0x7f..>; rank 1: <... at 0x7e..>). Policies
    are now compared by class and fields; fields that differ still raise, naming them."""
    assert run_ranks(_plain_policy, 2, (64, 64)) == ["trained", "trained"]
    for message in run_ranks(_plain_policy, 2, (64, 128)):
        assert "comm_policy differs" in message and "block=64" in message, message
        assert "block=128" in message and " at 0x" not in message, message


class _BlockingCollectives:
    """A comm policy whose collectives have finished when they return, and return None."""

    in_place_ok = True

    def __init__(self):
        from zero.comm.flat_collectives import FlatCollectives
        self.inner = FlatCollectives()

    def __repr__(self):
        return "_BlockingCollectives()"

    def all_gather(self, *args, **kwargs):
        self.inner.all_gather(*args, **kwargs).wait()

    def reduce_scatter(self, *args, **kwargs):
        self.inner.reduce_scatter(*args, **kwargs).wait()

    def all_reduce(self, *args, **kwargs):
        return self.inner.all_reduce(*args, **kwargs)


def _blocking_policy(rank, n, layout, blocking):
    model, opt = _gpt(3, layers=2, layout=layout,
                      comm_policy=_BlockingCollectives() if blocking else None)
    for s in range(2):
        _step(model, opt, rank, s)
    return zero.full_state_dict(model)


@pytest.mark.parametrize("layout", sample(["flat"], ["flat", "rows"]))
def test_a_comm_policy_whose_collectives_return_none_trains_like_the_default(layout):
    for ours, default in zip(run_ranks(_blocking_policy, 2, layout, True),
                             run_ranks(_blocking_policy, 2, layout, False)):
        assert all(torch.equal(ours[k], default[k]) for k in default)


def _apart(rank, n):
    policy = _PlainCollectives(64)
    policy.in_place_ok = False  # (it needs the shard apart from the full buffer)
    try:
        zero.shard(torch.nn.Linear(4, 4), stage=2, comm_policy=policy)
    except ValueError as e:
        return str(e)
    return "sharded"


def test_a_refusal_names_a_policy_by_its_fields_not_its_address():
    for message in run_ranks(_apart, 2):
        assert message.startswith("test_seams._PlainCollectives(block=64, ") and \
            " at 0x" not in message and "needs the shard apart" in message, message


# ---- the shape --------------------------------------------------------------------------------


def test_the_mechanism_keeps_its_shape():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "shape.py"), "--json"],
                         capture_output=True, text=True, check=True).stdout
    shape = json.loads(out)
    assert shape["largest_classes"][0][0] <= 25, shape["largest_classes"]
    assert shape["mutable_globals"] == []
    assert shape["upward_imports"] == []
    # every private torch name zero/ uses is in notes/15's table, with why
    chapter = open(os.path.join(ROOT, "notes", "15-where-ideas-go.md")).read()
    table = chapter[chapter.index("## The private torch machinery"):]
    unlisted = [n for n in shape["private_torch"] if n.rsplit(".", 1)[-1].lstrip("_") not in table]
    assert unlisted == [], unlisted


def test_chapter_15_is_written_from_the_protocols_and_zeros_own_objects_fit_them(tmp_path):
    """notes/15's table has a row for every seam of zero/api.py, and every object it names
    as zero's own passes the signature check ``zero.shard`` makes (so the chapter cannot
    claim fewer members than the mechanism uses, as it once did)."""
    import re

    from zero import api
    from zero.comm.backend import TorchBackend
    from zero.comm.flat_collectives import FlatCollectives
    from zero.core.flat import FlatLayout
    from zero.core.rows import RowsLayout
    from zero.core.schedule import Schedule
    from zero.core.whole import WholeLayout
    from zero.features.offload import CPUOffload, OnDevice
    from zero.features.quantized import QuantizedWeights

    chapter = open(os.path.join(ROOT, "notes", "15-where-ideas-go.md")).read()
    seams = [n for n, v in vars(api).items() if isinstance(v, type) and
             getattr(v, "_is_runtime_protocol", False) and v.__module__ == api.__name__]
    rows = re.findall(r"^\| `(\w+)`:", chapter, re.M)
    assert sorted(rows) == sorted(seams), (rows, seams)
    own = {
        "Layout": [FlatLayout, RowsLayout, WholeLayout],
        "CommPolicy": [FlatCollectives(), QuantizedWeights()],
        "OffloadPolicy": [OnDevice(), CPUOffload(), zero.DiskOffload(tmp_path)],
        "Schedule": [Schedule(prefetch=2)],
        "Backend": [TorchBackend(), LoggingBackend(tmp_path / "log")],
    }
    for name, objects in own.items():
        for obj in objects:
            api.check(obj, getattr(api, name), name, is_class=name == "Layout")
            assert getattr(obj, "__name__", type(obj).__name__) in chapter, obj


# ---- the ranks agree on every policy's parameters -----------------------------------------


def _policies(rank, n, field, tmp):
    kw = {"comm": dict(comm_policy=zero.QuantizedWeights(block=2 if rank == 0 else 14)),
          "layout": dict(layout="flat" if rank == 0 else "whole"),
          "prefetch": dict(prefetch=1 + rank),
          "mp": dict(mp_policy=zero.MixedPrecision(torch.bfloat16 if rank else torch.float16)),
          "offload": dict(offload_policy=zero.CPUOffload() if rank == 0 else None),
          "backend": dict(backend=LoggingBackend(os.path.join(tmp, "log")) if rank else None)}
    try:
        zero.shard(torch.nn.Linear(4, 4), stage=3, **kw[field])
    except ValueError as e:
        return str(e)
    return "sharded"


@pytest.mark.parametrize("field,named", [("comm", "comm_policy"), ("layout", "layout"),
                                         ("prefetch", "prefetch"), ("mp", "mp_policy"),
                                         ("offload", "offload_policy"), ("backend", "backend")])
def test_ranks_that_differ_on_a_policys_parameters_raise_naming_it(field, named, tmp_path):
    for message in run_ranks(_policies, 2, field, str(tmp_path)):
        assert f"{named} differs" in message, message
