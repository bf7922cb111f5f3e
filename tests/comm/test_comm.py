"""The collective wrappers (zero/comm/) on 2 and 3 real gloo ranks: data and ledger."""

import pytest
import torch

from conftest import sample
from harness import run_ranks
from zero import comm
from zero.comm.backend import TorchBackend


def _collectives(rank, n):
    out = {}
    with comm.Ledger() as ledger:
        # all-gather, out of place and in place, sync and async
        full = torch.empty(3 * n)
        comm.all_gather(full, torch.arange(3.0) + 10 * rank, unit="u", phase="forward")
        out["gather"] = torch.equal(full, torch.cat([torch.arange(3.0) + 10 * r for r in range(n)]))
        inplace = torch.zeros(2 * n)
        inplace[2 * rank : 2 * rank + 2] = rank + 1
        comm.all_gather(inplace, inplace[2 * rank : 2 * rank + 2], unit="u", phase="step",
                        async_op=True).wait()
        out["gather_inplace"] = inplace.tolist() == [float(r + 1) for r in range(n) for _ in (0, 1)]
        # reduce-scatter, SUM and AVG, against the local computation
        gen = [torch.Generator().manual_seed(r) for r in range(n)]
        inputs = [torch.randn(4 * n, generator=g) for g in gen]
        total = torch.stack(inputs).sum(0)
        for op, expect in [("sum", total), ("avg", total / n)]:
            shard = torch.empty(4)
            comm.reduce_scatter(shard, inputs[rank].clone(), op=op, unit="u", phase="backward",
                                async_op=(op == "avg")).wait() if op == "avg" else \
                comm.reduce_scatter(shard, inputs[rank].clone(), op=op, unit="u", phase="backward")
            out[f"rs_{op}"] = (shard - expect[4 * rank : 4 * rank + 4]).abs().max().item()
        # all-reduce SUM and MAX (the used-parameter mask is a uint8 MAX)
        t = torch.tensor([float(rank), 1.0])
        comm.all_reduce(t, op="sum", unit="u", phase="step")
        out["ar_sum"] = t.tolist() == [float(sum(range(n))), float(n)]
        mask = torch.tensor([rank == 0, rank == n - 1, False], dtype=torch.uint8)
        comm.all_reduce(mask, op="max")
        out["ar_max"] = mask.tolist() == [1, 1, 0]
        data = [r for r in ledger.records if r.op != "agree"]  # check mode agrees first
        out["records"] = [(r.op, r.dtype, r.buffer_bytes, r.sent_bytes, r.unit, r.phase)
                          for r in data]
        out["sent"] = sum(r.sent_bytes for r in data)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_compute_and_record(n):
    results = run_ranks(_collectives, n)
    for out in results:
        assert out["gather"] and out["gather_inplace"] and out["ar_sum"] and out["ar_max"]
        assert out["rs_sum"] < 1e-6 and out["rs_avg"] < 1e-6
    f32, ring = torch.float32, (n - 1) / n
    expect = [
        ("all_gather", f32, 12 * n, int(12 * n * ring), "u", "forward"),
        ("all_gather", f32, 8 * n, int(8 * n * ring), "u", "step"),
        ("reduce_scatter", f32, 16 * n, int(16 * n * ring), "u", "backward"),
        ("reduce_scatter", f32, 16 * n, int(16 * n * ring), "u", "backward"),
        ("all_reduce", f32, 8, int(2 * 8 * ring), "u", "step"),
        ("all_reduce", torch.uint8, 3, int(2 * 3 * ring), "", "other"),
    ]
    assert results[0]["records"] == expect
    assert results[0]["sent"] == sum(e[3] for e in expect)


def _avg_equals_sum_then_divide(rank, n):
    # Regression guard for pytorch#162338 (a wrong gloo AVG): AVG must equal SUM / n bitwise.
    x = torch.randn(1000 * n, generator=torch.Generator().manual_seed(rank))
    avg, summed = torch.empty(1000), torch.empty(1000)
    comm.reduce_scatter(avg, x.clone(), op="avg")
    comm.reduce_scatter(summed, x.clone(), op="sum")
    return torch.equal(avg, summed / n)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gloo_avg_is_sum_divided(n):
    assert all(run_ranks(_avg_equals_sum_then_divide, n))


def test_ledger_only_records_while_active_and_resets():
    def body(rank, n):
        x = torch.ones(4)
        comm.all_reduce(x)  # no ledger active: not recorded anywhere
        with comm.Ledger() as outer:
            with comm.Ledger() as inner:
                comm.all_reduce(x, phase="step")
            comm.all_reduce(x, phase="forward")
            op = "all_reduce"
            counts = (outer.count(op), inner.count(op), outer.count(op, phase="step"))
            outer.reset()
            return counts, outer.count()
    assert run_ranks(body, 2)[0] == ((2, 1, 1), 0)


def _timed(rank, n):
    with comm.Ledger() as ledger:
        x = torch.ones(1000)
        work = comm.all_reduce(x, unit="u", phase="step", async_op=True)
        pending = ledger.records[-1].done
        work.wait()
        comm.all_reduce(x, unit="u", phase="step")
        ctx = comm.CommContext()  # a model's context names its groups for the ledger
        ctx.name_group(None, "everyone")
        comm.all_reduce(x, unit="u", phase="step", ctx=ctx)
    data = [r for r in ledger.records if r.op == "all_reduce"]
    return pending, [(r.done is not None and r.done >= r.time, r.group) for r in data]


def test_records_know_when_the_wait_returned_and_which_group_they_crossed():
    pending, records = run_ranks(_timed, 2)[0]
    assert pending is None  # issued, not yet waited for
    assert records == [(True, "world"), (True, "world"), (True, "everyone")]


# ---- every wait is bounded (zero/comm/waits.py) ------------------------------------------------

def _alone_in(rank, n, op):
    """Rank 0 issues ``op``; rank 1 never does. Rank 0 must raise within ZERO_TIMEOUT."""
    import os
    import time

    os.environ["ZERO_CHECK"], os.environ["ZERO_TIMEOUT"] = "0", "1"
    if rank == 1:
        time.sleep(1.5)  # elsewhere, long enough for rank 0 to give up
        return None
    x = torch.ones(4)
    calls = {
        "all_gather": lambda: comm.all_gather(torch.empty(8), x, unit="u", phase="forward"),
        "reduce_scatter": lambda: comm.reduce_scatter(torch.empty(2), x, unit="u",
                                                      phase="backward", async_op=True).wait(),
        "all_reduce": lambda: comm.all_reduce(x, unit="u", phase="step"),
        "all_to_all": lambda: comm.all_to_all(torch.empty(4), x, unit="u", phase="backward"),
        "broadcast": lambda: comm.broadcast(x, unit="u", phase="forward"),
        "agree": lambda: comm.agree("do something", ctx=comm.CommContext()),
        "all_gather_object": lambda: comm.all_gather_object({"a": 1}),
    }
    start = time.monotonic()
    try:
        calls[op]()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "returned", time.monotonic() - start


@pytest.mark.parametrize("op", sample(  # gloo's three ways to wait: timeout, thread, objects
    ["all_gather", "reduce_scatter", "all_gather_object"],
    ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "agree",
     "all_gather_object"]))
def test_a_rank_alone_in_a_collective_raises_within_zero_timeout(op):
    kind, message, seconds = run_ranks(_alone_in, 2, op, timeout=30)[0]
    assert issubclass(getattr(comm, kind), comm.CollectiveTimeout), (kind, message)
    assert "waited 1 s for collective #" in message and "ZERO_TIMEOUT" in message, message
    assert 1 <= seconds < 3, seconds


def _raw_reduce_scatter_wait(rank, n):
    import datetime
    import time

    import torch.distributed as dist

    if rank == 1:
        time.sleep(2)  # joins late
    start = time.monotonic()
    work = dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4), async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=0.5))  # ignored by gloo: returns when done
    return time.monotonic() - start


def test_gloo_reduce_scatter_still_ignores_the_wait_timeout():
    """Why waits.py waits for gloo's reduce-scatter on a helper thread: its own wait(timeout)
    returns only when the collective completes. If this fails, torch fixed it: drop _IGNORED."""
    assert run_ranks(_raw_reduce_scatter_wait, 2, timeout=30)[0] > 1.5


def _no_thread_for_the_wait(rank, n):
    import threading

    def refuse(self):
        raise RuntimeError("can't start new thread")

    threading.Thread.start = refuse  # (a forked rank: nothing else runs threads after this)
    try:
        comm.reduce_scatter(torch.empty(2), torch.ones(4), unit="u", phase="backward")
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return "returned", ""


def test_a_wait_that_cannot_be_bounded_is_not_reported_as_a_timeout():
    """gloo's reduce-scatter is waited for on a helper thread; when none can start (no memory),
    that is the error, not 'the other ranks never joined' (which they did, at once)."""
    for kind, message in run_ranks(_no_thread_for_the_wait, 2):
        assert kind != "CollectiveTimeout" and "can't start new thread" in message, message


def test_a_collective_that_fails_early_says_so_not_that_it_waited_the_bound():
    """A peer that died (gloo aborts a process whose collective differs in size) closes its
    connections: the survivor's wait fails at once. Its message said it "waited 20 s" after
    0.7 s; it says how long it waited, and that a peer most likely died."""
    import os

    from zero.comm import waits

    class Work:
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer")

    class Backend:
        def bounded_wait(self, group, op):
            return "timeout"

        def rank(self, group=None):
            return 0

    ctx = comm.CommContext(Backend())
    os.environ["ZERO_TIMEOUT"] = "20"
    try:
        waits.wait(Work(), "#3 all_gather blocks.0 in forward", None, ctx)
    except comm.CollectiveTimeout as e:
        message = str(e)
    finally:
        del os.environ["ZERO_TIMEOUT"]
    assert "failed after 0.0 s, before the 20 s bound" in message and "died" in message
    assert "run again with ZERO_CHECK=1" in message
    assert "waited 20 s" not in message


# ---- host metadata: on a gloo group of the same ranks where the group moves device memory ---


class _DeviceOnly(TorchBackend):
    """torch.distributed as on a group that moves only device memory (NCCL's), on gloo."""

    def name(self, group=None) -> str:
        return "device-only"


def _host_twin(rank, n, disagree):
    import zero
    from zero.comm import backend
    from zerolab.models import GPT, GPTConfig

    backend._moves_host_memory = lambda pg: False  # (gloo has a CPU backend: say it has not)
    made, new_group = [], backend.dist.new_group
    backend.dist.new_group = lambda *a, **k: made.append(k.get("backend")) or new_group(*a, **k)
    out = {"twins made": made}
    for kind in ("twin", "default"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=2, dim=32, vocab=64, seq=8))
        for unit in model.units():  # (the backend is the root's to give)
            given = _DeviceOnly() if kind == "twin" and unit is model else None
            zero.shard(unit, stage=3, backend=given)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        top = zero.units_of(model)[0]
        ctx = top.root.context
        with comm.Ledger() as ledger:
            for s in range(2):
                x, y = model.batch(2, torch.Generator().manual_seed(10 * s + rank))
                if disagree and kind == "twin" and s == 1 and rank == 1:
                    with torch.no_grad():
                        model(x)  # a forward the other rank does not run under no_grad
                model.loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        host, _ = ctx.host(top.mesh.all_group)
        out[kind] = {"params": [p.detach().clone() for p in model.parameters()],
                     "separate": host is not top.mesh.all_group,
                     "groups": sorted({(r.op, r.group) for r in ledger.records
                                       if r.op in ("agree", "all_reduce")})}
    return out


def test_host_metadata_goes_through_a_gloo_twin_where_the_group_moves_only_device_memory():
    for out in run_ranks(_host_twin, 2, False):
        assert out["twin"]["separate"] and not out["default"]["separate"]
        # one for the group, not one per zero.shard call
        assert out["twins made"].count("gloo") == 1, out["twins made"]
        assert all(torch.equal(a, b) for a, b in zip(out["twin"]["params"],
                                                    out["default"]["params"]))
        assert out["twin"]["groups"] == out["default"]["groups"] == [
            ("agree", "world"), ("all_reduce", "world")]


def _twin_disagreement(rank, n):
    try:
        _host_twin(rank, n, True)
    except comm.Disagreement as e:
        return str(e)
    return "trained"


def test_ranks_that_disagree_on_the_twin_both_raise():
    said = run_ranks(_twin_disagreement, 2)
    assert all("the ranks took different paths" in s and "no_grad" in s for s in said), said
