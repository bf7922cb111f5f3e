"""The emulated GPU cluster (zerolab/emulate.py): a log played as a GPU runs its streams, every
system's results bitwise unchanged by the recording, the trace a Chrome trace, and the main
job's --network tables."""

import contextlib
import json
import os
import sys
import warnings

import pytest
import torch

from harness import run_ranks
from zerolab import emulate
from zerolab.cost import Cluster
from zerolab.models import GPT, GPTConfig
from zerolab.systems import System

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

# a link where a collective of B bytes sent lasts 1 + B seconds (alpha-beta, 2 ranks, 1 GB/s)
SLOW = emulate.Network("test", Cluster("test", ranks_per_node=2, intra_gbs=1e-9, inter_gbs=1e-9,
                                       intra_alpha_us=1e6))
PAIR = (0, 1)


def issue(wid, stream, op="all_gather", sent=2.0, async_op=False):
    return ("issue", wid, stream, op, 2 * sent, sent, PAIR, async_op)


def test_a_side_stream_collective_runs_under_compute_and_only_the_wait_is_exposed():
    log = [("wait_stream", 5, 0), issue(1, 5), ("record", 5, 10),  # 3 s on stream 5, at once
           ("run", 0, 2.0),  # 2 s of compute beside it
           ("wait_event", 0, 10),  # the computing stream waits: 1 s exposed
           ("run", 0, 1.0), ("sync",)]
    p = emulate.play(log, SLOW)
    assert (p.step_s, p.compute_s) == (4.0, 3.0)
    assert p.exposed == {"all_gather": 1.0} and p.comm == {"all_gather": 3.0}
    assert p.overlap == pytest.approx(2 / 3)


def test_a_blocking_collective_on_the_computing_stream_is_all_exposed():
    p = emulate.play([("run", 0, 1.0), issue(1, 0, "reduce_scatter"), ("run", 0, 1.0),
                      ("sync",)], SLOW)
    assert p.step_s == 5.0 and p.exposed == {"reduce_scatter": 3.0} and p.overlap == 0.0


def test_an_async_collective_waits_by_its_work_and_queues_behind_the_link():
    log = [issue(1, 0, async_op=True), issue(2, 0, "all_reduce", sent=1.0, async_op=True),
           ("run", 0, 4.0), ("wait_work", 0, 2), ("sync",)]
    p = emulate.play(log, SLOW)  # 0-3 the first, 3-6 the second (one link; 2 latencies)
    assert p.step_s == 6.0 and p.exposed == {"all_reduce": 2.0}


def test_a_side_streams_compute_runs_in_the_background_after_its_waits():
    log = [("run", 0, 1.0), ("wait_stream", 7, 0), ("run", 7, 5.0), ("record", 7, 3),
           ("run", 0, 1.0), ("wait_event", 0, 3), ("sync",)]
    p = emulate.play(log, SLOW)
    assert p.step_s == 6.0 and p.side_compute_s == 5.0
    assert p.exposed == {"copy": 4.0} and p.exposed_s == 0.0  # (not communication)


def test_two_nodes_cost_more_than_one_and_bad_specs_are_refused():
    one, two = emulate.network("dgx-h100", 4), emulate.network("dgx-h100:2-nodes", 4)
    ranks = (0, 1, 2, 3)
    assert two.seconds("all_gather", 8e6, 6e6, ranks) > one.seconds("all_gather", 8e6, 6e6, ranks)
    assert emulate.network("dgx-h100", 2, dilation=10).seconds("all_reduce", 1e6, 1e6, PAIR) == \
        pytest.approx(10 * one.seconds("all_reduce", 1e6, 1e6, PAIR))
    with pytest.raises(ValueError, match="unknown network"):
        emulate.network("no-such", 2)
    with pytest.raises(ValueError, match="evenly"):
        emulate.network("dgx-h100:3-nodes", 4)


def _train(rank, n, kind, record):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=64, seq=8, dim=16, layers=2, heads=2))
    logs = []
    recorder = emulate.Recorder() if record else None
    with recorder if recorder else contextlib.nullcontext():
        system = System(kind, base, "adamw")
        if kind.startswith("ddp"):  # (a Python hook: DDP's all-reduce then passes the emulation)
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            system.model.register_comm_hook(None, allreduce_hook)
        for i in range(2):
            if recorder:
                with recorder.step() as log:
                    system.step(rank, i, batch=2)
                logs.append(log)
            else:
                system.step(rank, i, batch=2)
    assert torch.cpu.Stream is not emulate.Stream  # restored
    return system.full_params(), logs


@pytest.mark.parametrize("kind", ["ddp", "zero3", "fsdp2"])
def test_recording_changes_no_bit_and_sees_every_collective(kind):
    plain = run_ranks(_train, 2, kind, False)
    recorded = run_ranks(_train, 2, kind, True)
    for (a, _), (b, logs) in zip(plain, recorded):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        issued = {e[3] for log in logs for e in log if e[0] == "issue"}
        expect = {"ddp": {"all_reduce"}, "zero3": {"all_gather", "reduce_scatter"},
                  "fsdp2": {"all_gather", "reduce_scatter"}}[kind]
        assert expect <= issued, issued
        waited = [e for log in logs for e in log if e[0] in ("wait_work", "wait_event")]
        assert waited, "no wait recorded"
        played = emulate.play(logs[-1], emulate.network("dgx-h100", 2, dilation=100.0))
        assert played.comm_s > 0 and played.step_s >= played.compute_s > 0
    summary = emulate.summarize([logs for _, logs in recorded],
                                emulate.network("dgx-h100:2-nodes", 2, dilation=100.0))
    assert 0.0 <= summary["overlap"] <= 1.0 or summary["exposed_s"] > summary["comm_s"]
    trace = emulate.chrome_trace([(kind, *summary["trace"], 100.0)])
    events = json.loads(json.dumps(trace))["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "compute" in tracks and len(tracks) >= 2, tracks
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_the_main_job_plays_every_round_on_each_network(tmp_path):
    import compare_stages
    import report

    args = compare_stages.parse_args([
        "--layers", "2", "--dim", "16", "--seq", "8", "--batch", "2", "--steps", "1",
        "--systems", "ddp,zero3", "--network", "dgx-h100,dgx-h100:2-nodes", "--rounds", "2"])
    rows = compare_stages.compare(args, lead=True)
    assert [len(r["emulated"][spec]) for r in rows for spec in args.network] == [2] * 4
    assert args.emulation["cpu_step_s"] > 0
    assert all(n["dilation"] > 0 for n in args.emulation["networks"].values())
    lines = report.emulated_tables(rows, args)
    assert sum(line.startswith("| zero3 |") for line in lines) == 4  # (and the roofline clock's)
    for r in rows:  # the roofline's clock prices the same operators alike in every round
        computes = {x["compute_s"] for x in r["emulated_roofline"]["dgx-h100"]}
        assert len(computes) == 1 and computes.pop() > 0, r["kind"]
    assert sum(line.startswith("| zero3 step time / DDP's |") for line in lines) == 2
    path = report.write_trace(rows, args, str(tmp_path / "t.json"))
    with open(path) as f:
        assert len(json.load(f)["traceEvents"]) > 10


@pytest.mark.full  # (a --targets run; ZERO_FULL=1 runs it)
def test_the_targets_run_writes_every_verdict_and_the_plan_beside_them(tmp_path, monkeypatch):
    import compare_stages

    monkeypatch.setattr(compare_stages, "TARGET_WORLD_SIZES", [2])
    out = tmp_path / "targets.md"
    compare_stages.main(["--targets", "--layers", "2", "--dim", "16", "--seq", "8", "--batch",
                         "2", "--steps", "1", "--rounds", "2", "--systems",
                         "ddp,zero1,zero3,fsdp2", "--out", str(out)])
    text = out.read_text()
    verdicts = [line for line in text.splitlines()
                if line.startswith("| GPT 2 x 16") and "<=" in line]
    # ZeRO-3 against FSDP2 (exposed, step) and ZeRO-1 against DDP, on each of the two networks
    assert len(verdicts) == 3 * 2, verdicts
    assert all(cell.strip() in ("yes", "no") for v in verdicts for cell in v.split("|")[7:9])
    assert "dilation" in text and "torch " in text and "roofline clock" in text
    trace = str(out).removesuffix(".md") + ".trace.json.gz"
    import gzip

    with gzip.open(trace, "rt") as f:
        assert json.load(f)["traceEvents"]
