"""FSDP2's training scenarios, ported: every stage trains like torch's reference and like
``fully_shard`` on the same units, bitwise at world size 2 (tests/fsdp2_port.py has the systems).

Each test names the torch test it ports (``test/distributed/_composable/fsdp/`` in the PyTorch
repository). The models are torch's own test models (``torch.testing._internal``), made small;
torch runs 10 iterations, we run 2 or 3. notes/11-conformance.md lists every scenario considered.
"""

import functools
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

import zero
from fsdp2_port import (
    ALL,
    ZERO,
    Trainer,
    average_grads,
    data,
    fsdp2_collectives,
    mismatches,
    of,
    train,
)
from conftest import sample
from harness import run_ranks

ITERS = 2
VOCAB = 64


def transformer(**kw) -> Transformer:
    """torch's test Transformer, small (2 blocks, dim 16, vocab 64), without dropout."""
    torch.manual_seed(42)
    args = dict(n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=16, dropout_p=0.0)
    return Transformer(ModelArgs(**{**args, **kw}))


def blocks_then_root(model: nn.Module) -> list[nn.Module]:
    return [*model.layers, model]


def token_loss(rank: int):
    return lambda model, it: model(data(rank, it, 3, 16, vocab=VOCAB)).sum()


# ---- test_fully_shard_training.py, TestFullyShard1DTrainingCore ---------------------------------


def _single_group(rank, n):
    out = []
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        torch.manual_seed(42)
        base = nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))
        trainers = [Trainer(k, base, lambda m: [m]) for k in ("replicate", "fsdp2", *ZERO)]
        out += train(trainers, ITERS, lambda m, it: m(data(rank, it, 4, shapes[0][0])).sum())
    return out


def test_train_parity_single_group():
    # Ports test_train_parity_single_group_shard_dim0: one unit, uneven shapes.
    assert run_ranks(_single_group, 2) == [[], []]


def _multi_group(rank, n):
    out = []
    for raf in (None, False):
        base = transformer()
        trainers = [Trainer(k, base, blocks_then_root, raf=raf)
                    for k in ("replicate", "fsdp2", *ZERO)]
        out += train(trainers, 3, token_loss(rank))
    return out


def test_train_parity_multi_group():
    # Ports test_train_parity_multi_group: one unit per block plus the root; reshard_after_forward
    # by default and False (True: the checkpointing and shared-parameter tests below). torch's
    # delays only move CUDA streams, which gloo on CPU does not have.
    assert run_ranks(_multi_group, 2) == [[], []]


def _non_root_forward_backward(rank, n):
    torch.manual_seed(42)
    base = nn.Sequential(*[MLP(8) for _ in range(3)])
    trainers = [Trainer(k, base, lambda m: [*m, m]) for k in ALL]
    inp = data(rank, 0, 4, 8)
    # the root, then the first block alone, then the root again, then the second block alone
    calls = [lambda m: m, lambda m: m[0], lambda m: m, lambda m: m[1]]
    return train(trainers, len(calls), lambda m, it: calls[it](m)(inp).sum())


def test_non_root_forward_backward():
    # Ports test_non_root_forward_backward: forward/backward through a non-root unit alone.
    assert run_ranks(_non_root_forward_backward, 2) == [[], []]


class MultiForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def _multi_forward_module(rank, n):
    out = []
    for raf in (True, False):
        torch.manual_seed(42)
        base = MultiForward()
        trainers = [Trainer(k, base, lambda m: [m.inner, m], raf=raf)
                    for k in ("replicate", "fsdp2", *ZERO)]
        out += train(trainers, ITERS, lambda m, it: m(data(rank, it, 8, 4)).sum())
    return out


def test_multi_forward_module():
    # Ports test_multi_forward_module: a unit called twice in one forward.
    assert run_ranks(_multi_forward_module, 2) == [[], []]


# ---- test_fully_shard_training.py, TestFullyShard1DTrainingCompose ------------------------------


def with_checkpointing(impl: str):
    """Activation checkpointing on every block, as torch's test applies it: torch.utils inside
    the Transformer's forward ("utils"), the composable ``checkpoint`` on each block, or
    ``apply_activation_checkpointing`` (a wrapper that checkpoints inside the unit's forward)."""
    def prepare(model):
        if impl == "composable":
            for block in model.layers:
                composable_checkpoint(block)
        elif impl == "wrapper":
            apply_activation_checkpointing(
                model, check_fn=lambda m: isinstance(m, TransformerBlock))
    return prepare


def _activation_checkpointing(rank, n):
    """{impl: mismatches} for the three ways to checkpoint."""
    out = {}
    for impl in ("utils", "composable", "wrapper"):
        out[impl] = []
        for raf in (True, False) if impl == "wrapper" else (True,):
            base = transformer(checkpoint_activations=impl == "utils")
            trainers = [Trainer(k, base, blocks_then_root, raf=raf,
                                prepare=with_checkpointing(impl))
                        for k in ("replicate", "fsdp2", *ZERO)]
            out[impl] += train(trainers, ITERS, token_loss(rank))
    return out


@functools.cache
def activation_checkpointing():
    return run_ranks(_activation_checkpointing, 2)  # one run for the three tests below


@pytest.mark.parametrize("impl", sample(["composable"], ["utils", "composable", "wrapper"]))
def test_train_parity_with_activation_checkpointing(impl):
    # Ports test_train_parity_with_activation_checkpointing, module_grouping="block" (the other
    # groupings put several modules in one unit: notes/11-conformance.md). The wrapper
    # checkpoints inside the unit's forward: both reshard_after_forward values; the others
    # checkpoint around the unit: True only (False is the same path as without checkpointing).
    assert [ranks[impl] for ranks in activation_checkpointing()] == [[], []]


def nested_units(model: nn.Module) -> list[nn.Module]:
    """Attention and feed-forward units inside each block unit, then the root."""
    return [u for b in model.layers for u in (b.attention, b.feed_forward, b)] + [model]


def _double_forward(rank, n):
    """Two forwards, then one backward through both (DPO)."""
    base = transformer(checkpoint_activations=True)  # "utils"; tied, as torch's default

    def loss_of(m, it):
        a, b = (data(rank, 2 * it + i, 2, 16, vocab=VOCAB) for i in (0, 1))
        return (m(a).sum() - m(b).sum()).pow(2) * 1e-4

    return train([Trainer(k, base, nested_units, raf=True) for k in ALL], ITERS, loss_of)


def test_double_forward_with_nested_units_and_checkpoint():
    # Ports test_double_forward_with_nested_fsdp_and_checkpoint (the DPO pattern: checkpoint
    # "utils", attention and feed-forward units nested in block units, torch's tied embedding
    # and output; issue 11 case 8, fixed in b7b0865), with parity against the reference.
    assert run_ranks(_double_forward, 2) == [[], []]


class ChunkedHead(nn.Module):
    """torch's ChunkedHeadModel: the head can be skipped, then called on chunks of the hidden."""

    def __init__(self, dim=16, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, skip_head=False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def chunked_backward(trainer, tokens, chunks=4):
    """The chunked-loss pattern: forward without the head, one head forward and backward per
    chunk of the hidden states, then backward through the rest with the chunks' gradients."""
    h = trainer.model(tokens, skip_head=True)
    grads, total = [], 0.0
    for chunk in torch.chunk(h.detach(), chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = trainer.model.head(chunk).sum()
        loss.backward()
        total += loss.detach()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads, dim=1))
    if trainer.kind == "ref":
        average_grads(trainer.model)
    return total


def _chunked_head(rank, n):
    out = []
    for raf in (True, False):
        torch.manual_seed(42)
        base = ChunkedHead()
        trainers = [Trainer(k, base, lambda m: [m.embed, m.body, m.norm, m.head, m], raf=raf)
                    for k in ALL]
        for it in range(ITERS):
            tokens = data(rank, it, 2, 8, vocab=32)
            for t in trainers:
                chunked_backward(t, tokens)
            # The reference sums the chunks locally, then averages once; the sharded systems
            # reduce every chunk's backward: equal within rounding only (as torch's test).
            out += mismatches(trainers, f"iteration {it}", grads=True, exact=False)
            out += mismatches(trainers[1:], f"iteration {it}", grads=True)  # ours vs FSDP2
            for t in trainers:
                t.step(it)
            out += mismatches(trainers[1:], f"iteration {it}")
    return out


@pytest.mark.full  # sampled: torchtitan's chunked loss covers it in the suite
def test_partial_forward_then_standalone_head_chunks():
    # Ports test_partial_group_forward_then_standalone, ungrouped (norm and head are their own
    # units; the grouped variant needs a unit of several modules), without mixed precision.
    assert run_ranks(_chunked_head, 2) == [[], []]


class Raiser(nn.Module):
    def __init__(self, wrapped):
        super().__init__()
        self.wrapped, self.armed = wrapped, False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("boom")
        return self.wrapped(x)


def _exception_in_forward(rank, n):
    torch.manual_seed(42)
    base = ChunkedHead()
    base.body = Raiser(base.body)
    trainers = [Trainer(k, base, lambda m: [m.norm, m.head, m]) for k in ALL]
    for t in trainers:
        t.model.body.armed = True
        with pytest.raises(RuntimeError, match="boom"):
            t.model(data(rank, 99, 2, 8, vocab=32), skip_head=True)
        t.model.body.armed = False
    return train(trainers, 2, lambda m, it: m(data(rank, it, 2, 8, vocab=32)).sum())


def test_training_after_an_exception_in_forward():
    # Ports test_reset_iter_state_after_exception: zero needs no reset_iter_state; the next
    # iterations train like the reference.
    assert run_ranks(_exception_in_forward, 2) == [[], []]


# ---- TestFullyShardForwardInputs, TestFullyShardRegisteredParams --------------------------------


class NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self):
        return self.weight @ self.weight


def _no_inputs_and_registered_params(rank, n):
    torch.manual_seed(42)
    base = NoInputs()
    out = train([Trainer(k, base, lambda m: [m]) for k in ALL], ITERS, lambda m, it: m().sum())
    # After backward the module holds its sharded parameters again (this rank's 1-D pieces).
    torch.manual_seed(42)
    for stage in (1, 2, 3):
        model = MLP(8)
        zero.shard(model.in_proj, stage=stage)
        zero.shard(model, stage=stage)
        model(torch.randn(2, 8)).sum().backward()
        owned = {id(p) for u in zero.units_of(model) for p in u.params}
        if not all(id(p) in owned and p.dim() == 1 for p in model.parameters()):
            out.append(f"zero{stage}: parameters after backward are not the sharded pieces")
    return out


def test_root_without_inputs_and_params_registered_after_backward():
    # Ports TestFullyShardForwardInputs.test_root_no_forward_inputs and
    # TestFullyShardRegisteredParams.test_param_registration_after_backward.
    assert run_ranks(_no_inputs_and_registered_params, 2) == [[], []]


# ---- TestFullyShardSharedParams ---------------------------------------------------------------


def _shared_params(rank, n):
    out = []
    for raf, ac in ((True, False), (False, True)):
        base = transformer(weight_tying=True)
        prepare = with_checkpointing("composable" if ac else "none")
        trainers = [Trainer(k, base, blocks_then_root, raf=raf, prepare=prepare)
                    for k in ("replicate", "fsdp2", *ZERO)]
        out += train(trainers, ITERS, token_loss(rank))
    return out


def test_train_parity_with_shared_params():
    # Ports test_train_parity_with_shared_params (tied embedding and output, in the root unit),
    # reshard_after_forward True, and False with composable checkpointing.
    assert run_ranks(_shared_params, 2) == [[], []]


class Tied(nn.Module):
    def __init__(self, vocab, dim=16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        return self.output(self.tok_embeddings(ids))


def _tied_uneven_and_separate_units(rank, n):
    out = []
    vocab = 2 * 4 + 1  # not divisible by the world size: the last rank's shard is padded
    for stage in (1, 2, 3):
        torch.manual_seed(42)
        model = Tied(vocab)
        zero.shard(model, stage=stage)
        before = zero.full_state_dict(model)["tok_embeddings.weight"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for it in range(3):
            ids = data(rank, it, 2, 8, vocab=vocab)
            logits = model(ids)
            nn.functional.cross_entropy(logits.view(-1, vocab), ids.view(-1)).backward()
            opt.step()
            opt.zero_grad()
        after = zero.full_state_dict(model)["tok_embeddings.weight"]
        out += [f"zero{stage}: row {r} not updated" for r in range(vocab)
                if torch.equal(before[r], after[r])]
        # test_shared_params_separate_fsdp_groups_error: a tied parameter split across units
        split = Tied(vocab)
        zero.shard(split.tok_embeddings, stage=stage)
        with pytest.raises(ValueError, match="shared"):
            zero.shard(split.output, stage=stage)
    return out


def test_shared_params_uneven_shard_and_separate_units_error():
    # Ports test_train_shared_params_uneven_shard (every row trains, the padded one too) and
    # test_shared_params_separate_fsdp_groups_error (zero raises when sharding, FSDP2 at the
    # first forward).
    assert run_ranks(_tied_uneven_and_separate_units, 2) == [[], []]


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.linear(self.norm(x))


def _layer_by_layer(rank, n):
    model = nn.Sequential()
    for _ in range(4):
        block = Block()
        model.append(block)
        zero.shard(block, stage=3)
        gc.collect(0)  # ids of freed tensors get reused: ownership must not be keyed by id alone
    zero.shard(model, stage=3)
    model(torch.randn(2, 4, 16)).sum().backward()
    return [n for n, p in model.named_parameters() if p.grad is None]


def test_layer_by_layer_shard_no_false_positive():
    # Ports test_layer_by_layer_shard_no_false_positive.
    assert run_ranks(_layer_by_layer, 2) == [[], []]


# ---- TestFullyShardGradientAccumulation ---------------------------------------------------------


def accumulate(rank, trainers, iters, micro, which=lambda model: None):
    """torch's gradient accumulation loop: ``micro`` micro-batches per step, gradient sync only
    on the last one (on ``which(model)``'s units; None: all). Returns mismatches and, per system,
    (all-gathers, reduce-scatters) of each step's forwards and backwards."""
    out, counts = [], {t.kind: [] for t in trainers}
    for it in range(iters):
        for t in trainers:
            with zero.Ledger() as ledger, fsdp2_collectives() as fsdp2:
                for mb in range(micro):
                    inp = data(rank, 10 * it + mb, 2, 8)
                    if mb == micro - 1:
                        t.backward(t.model(inp).sum())
                    else:
                        with t.no_sync(which(t.model)):
                            t.backward(t.model(inp).sum(), sync=False)
            counts[t.kind].append(
                (ledger.count("all_gather"), ledger.count("reduce_scatter")) if t.kind in ZERO
                else (fsdp2["all_gather"], fsdp2["reduce_scatter"]))
        out += mismatches(trainers[1:], f"iteration {it}", grads=True)  # ours vs FSDP2, bitwise
        out += mismatches(trainers, f"iteration {it}", grads=True, exact=False)
        for t in trainers:
            t.step(it)
    return out + mismatches(trainers[1:], "the end"), counts


def _gradient_accumulation(rank, n, mode):
    out, counts = [], []
    for raf in (True, False) if mode == "all" else (True,):
        torch.manual_seed(42)
        base = nn.Sequential(nn.Linear(8, 8), *[MLP(8) for _ in range(3)])
        trainers = [Trainer(k, base, lambda m: [*m[1:], m], raf=raf) for k in ALL]
        which = (lambda m: None) if mode == "all" else (lambda m: list(m[1:3]))
        bad, c = accumulate(rank, trainers, 2, 3, which)
        out += bad
        counts.append(c)
    return out, counts


@pytest.mark.full  # sampled: ..._some_units runs in the suite
def test_gradient_accumulation_all_units():
    # Ports test_gradient_accumulation, mode "all" (set_requires_gradient_sync(False) on the
    # root): ours equal FSDP2 bitwise, and issue FSDP2's reduce-scatters (one per unit, on the
    # last micro-batch) and, at stage 3, its all-gathers.
    out, counts = run_ranks(_gradient_accumulation, 2, "all")[0]
    assert out == []
    for c, raf in zip(counts, (True, False)):
        for kind in ("zero1", "zero2"):  # (stages 1 and 2 gather once a step, not here)
            assert [rs for _, rs in c[kind]] == [rs for _, rs in c["fsdp2"]] == [4, 4]
        assert c["zero3"] == c["fsdp2"] == [(24 if raf else 12, 4)] * 2


def test_gradient_accumulation_some_units():
    # Ports test_gradient_accumulation, mode "some_mlps": no_sync on two of the three MLP units
    # only; the others (and the root) reduce every micro-batch, as in FSDP2, at every stage
    # (issue 11 case 2, fixed in b7b0865).
    out, counts = run_ranks(_gradient_accumulation, 2, "some_mlps")[0]
    assert out == []
    for c in counts:
        for kind in ("zero1", "zero2"):
            assert [rs for _, rs in c[kind]] == [rs for _, rs in c["fsdp2"]] == [8, 8]
        assert c["zero3"] == c["fsdp2"]


def _one_f_one_b(rank, n):
    torch.manual_seed(42)
    base = transformer(n_layers=2)
    trainers = [Trainer(k, base, blocks_then_root, raf=False) for k in ALL]
    out = []
    inputs = [data(rank, m, 2, 16, vocab=VOCAB) for m in range(3)]
    for m, inp in enumerate(inputs):
        for t in trainers:
            if m < len(inputs) - 1:
                with t.no_sync():
                    t.backward(t.model(inp).sum(), sync=False)
            else:
                t.backward(t.model(inp).sum())
    out += mismatches(trainers, "after accumulation", grads=True)
    for t in trainers:
        t.step(0)
    return out + mismatches(trainers, "after the step")


def test_1f1b_microbatching():
    # Ports test_1f1b_microbatching without explicit unshard() (zero has no public unshard):
    # reshard_after_forward=False, gradient sync on the last micro-batch only.
    assert run_ranks(_one_f_one_b, 2) == [[], []]


# ---- TestFullyShardWorldSize1 ----------------------------------------------------------------


def _world_size_1(rank, n):
    torch.manual_seed(42)
    base = nn.Sequential(nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 8))
    trainers = [Trainer(k, base, lambda m: [m]) for k in ("ref", "fsdp2", *ZERO)]
    out = train(trainers, ITERS, lambda m, it: m(data(rank, it, 4, 16)).sum())
    issued = {}
    for t in trainers[2:]:
        with zero.Ledger() as ledger:
            t.backward(t.model(data(rank, 9, 4, 16)).sum())
        issued[t.kind] = [(r.op, r.phase) for r in ledger.records]
    return out, issued


def test_world_size_1_trains_like_one_process_without_collectives():
    # Ports test_train_parity_single_worldsize1: parity, and no collective at all (FSDP2's
    # CommDebugMode count is 0; issue 11 case 9, fixed in b7b0865).
    out, issued = run_ranks(_world_size_1, 1)[0]
    assert out == []
    assert issued == {k: [] for k in ZERO}
