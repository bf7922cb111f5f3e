"""A real multi-node launch (benchmarks/multinode.py): two torchrun launchers of 2 ranks each,
meeting through the c10d rendezvous on localhost, train DDP and our three stages and HSDP on
the 2 x 2 mesh, and their losses equal 4 ranks on one machine bit for bit (forked here; the
script's own check, `python benchmarks/multinode.py`, runs every system and a second torchrun).

Unlike the other tests, these ranks are not forked from pytest: the run starts two torchrun
agents and 4 fresh Python processes, each importing torch, so the model is tiny.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import multinode  # noqa: E402

SYSTEMS = ["ddp", "zero1", "zero2", "zero3"]  # torch's own systems need no multi-node check of ours


@pytest.mark.full  # 20 s of fresh processes: ZERO_FULL=1 pytest runs it
def test_two_launchers_train_bitwise_like_one():
    args = multinode.parse_args(["--layers", "2", "--dim", "32", "--seq", "8", "--batch", "2",
                                 "--steps", "2", "--timeout", "120", "--systems", ",".join(SYSTEMS)])
    rows = multinode.check(args, forked_reference=True)
    print(multinode.table(rows, args))
    systems = [name for name, *_ in rows]
    assert systems == [*SYSTEMS, "zero3 hsdp 2x2", "fsdp2 hsdp 2x2"], systems
    different = [name for name, *_, equal in rows if not equal]
    assert not different, multinode.table(rows, args)
    values = {name: n for name, n, *_ in rows}
    assert values["ddp"] == 4 * 4 and values["fsdp2 hsdp 2x2"] == 4 * 2  # 4 ranks x steps


def test_the_check_sees_one_bit():
    losses = [[2.5, 2.25], [2.5, 2.0]]
    nudged = [[2.5, 2.25], [2.5, 2.0000000000000004]]  # the next double after 2.0
    rows = multinode.compare_runs({"ddp": losses, "zero3": losses}, {"ddp": losses, "zero3": nudged})
    assert [(name, equal) for name, *_, equal in rows] == [("ddp", True), ("zero3", False)]
    assert not multinode.compare_runs({"ddp": losses}, {})[0][-1]  # missing from one run
