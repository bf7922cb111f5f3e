"""FSDP2's communication scenarios (test_fully_shard_comm.py), ported: how many all-gathers and
reduce-scatters a step issues, and in which order, counted with our Ledger for our stages and
by patching ``torch.distributed`` for ``fully_shard`` (as torch's tests do).

Stage 3 issues FSDP2's collectives; stages 1 and 2 keep the parameters, so they gather each
unit once per optimizer step. Besides, every stage all-reduces one byte per parameter at the
end of backward so that the ranks agree on which parameters got a gradient (FSDP2 has no such
collective, and gets rank-dependent unused parameters wrong: notes/11-conformance.md), and the
ranks' small agreements (``zero.comm.agree``) are not counted.
"""

import functools

import pytest
import torch
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

import zero
from fsdp2_port import ZERO, Trainer, data, fsdp2_collectives
from harness import run_ranks

BLOCKS = 3


def units(model):
    return [*[m for m in model.modules() if isinstance(m, TransformerBlock)], model]


def _counts(rank, n):
    """{raf: {system: [forward, backward] collectives}}, counted in a second iteration."""
    torch.manual_seed(42)
    base = Transformer(ModelArgs(n_layers=BLOCKS, dropout_p=0.0))
    inp = data(rank, 0, 2, 16, vocab=8)
    return {raf: _counts_for(base, inp, raf) for raf in (None, True, False)}


def _counts_for(base, inp, raf):
    got = {}
    for kind in ("fsdp2", *ZERO):
        t = Trainer(kind, base, units, raf=raf)
        t.backward(t.model(inp).sum())  # a first iteration, so that prefetching has an order
        phases = []
        for phase in ("step and forward", "backward"):
            with zero.Ledger() as ledger, fsdp2_collectives() as fsdp2:
                if phase == "step and forward":
                    t.step(0)  # stages 1 and 2 gather the updated parameters after it
                    loss = t.model(inp).sum()
                else:
                    loss.backward()
            if kind == "fsdp2":
                phases.append(fsdp2)
            else:
                phases.append({op: ledger.count(op) for op in ("all_gather", "reduce_scatter",
                                                                 "all_reduce")})
                phases[-1]["order"] = [(r.op, r.unit) for r in ledger.records
                                       if r.op != "agree"]  # (the ranks' small agreements)
        got[kind] = phases
    return got


@functools.cache
def counts():
    return run_ranks(_counts, 2)[0]  # one run for the three tests below


@pytest.mark.parametrize("raf", [None, True, False])
def test_communication_count_and_order(raf):
    # Ports TestFullyShardCommunication.test_fully_shard_communication_count (counts) and
    # TestFullyShardPrefetch._test_backward_prefetch_forward_backward (the order: each block's
    # gather is issued one block ahead, its reduce-scatter when its gradient is complete).
    got = counts()[raf]
    forward, backward = got["fsdp2"]
    assert forward == {"all_gather": BLOCKS + 1, "reduce_scatter": 0}
    gathers = {None: BLOCKS, True: BLOCKS + 1, False: 0}[raf]  # the root keeps, by default
    assert backward == {"all_gather": gathers, "reduce_scatter": BLOCKS + 1}
    f3, b3 = got["zero3"]
    assert (f3["all_gather"], f3["reduce_scatter"], f3["all_reduce"]) == (BLOCKS + 1, 0, 0)
    assert (b3["all_gather"], b3["reduce_scatter"], b3["all_reduce"]) == (gathers, BLOCKS + 1, 1)
    assert f3["order"] == [("all_gather", u) for u in ("root", "layers.0", "layers.1", "layers.2")]
    expected = [("all_gather", "layers.2"), ("all_gather", "layers.1"),
                ("reduce_scatter", "layers.2"), ("all_gather", "layers.0"),
                ("reduce_scatter", "layers.1"), ("reduce_scatter", "layers.0"),
                ("reduce_scatter", "root"), ("all_reduce", "root")]
    if raf:
        expected.insert(0, ("all_gather", "root"))
    if raf is False:
        expected = [e for e in expected if e[0] != "all_gather"]
    assert b3["order"] == expected
    for kind in ("zero1", "zero2"):  # one gather a unit per step; none in backward
        f, b = got[kind]
        assert (f["all_gather"], f["reduce_scatter"], f["all_reduce"]) == (BLOCKS + 1, 0, 0)
        assert (b["all_gather"], b["reduce_scatter"], b["all_reduce"]) == (0, BLOCKS + 1, 1)
