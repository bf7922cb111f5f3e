"""The three layouts' index math (zero/core/flat.py, rows.py, whole.py), single process.

What every layout must give, checked with hypothesis on shapes and world sizes: every element
of every parameter held by exactly one rank, at the place its piece says; shards of one size
that tile the gathered buffer; and the trip shard -> all-gather -> compute buffer -> views
giving the parameters back, and the trip compute buffer -> reduce-scatter buffer -> slot
giving each rank exactly its pieces.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero.core.flat import FlatLayout
from zero.core.rows import RowsLayout
from zero.core.whole import WholeLayout

LAYOUTS = [FlatLayout, RowsLayout, WholeLayout]
# Shapes of 1 to 3 dims with sizes 0..7 (rows cannot cut a 0-d parameter: FSDP2 neither)
shapes = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3), min_size=1, max_size=6)
world_sizes = st.integers(1, 8)
EXAMPLES = settings(max_examples=300, deadline=None)


def _tensors(shape_list, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shape_list]


@pytest.mark.parametrize("layout_cls", LAYOUTS, ids=lambda c: c.name)
@EXAMPLES
@given(shape_list=shapes, n=world_sizes)
def test_every_element_is_held_once_in_equal_shards(layout_cls, shape_list, n):
    layout = layout_cls(shape_list, n)
    assert layout.padded_numel == n * layout.shard_numel >= layout.numel
    seen = [[0] * math.prod(s) for s in shape_list]
    for r in range(n):
        assert layout.shard(r).size == layout.shard_numel
        assert layout.shard(r).offset == r * layout.shard_numel
        ends = []
        for piece in layout.pieces(r):
            assert piece.length > 0 and piece.shard_offset + piece.length <= layout.shard_numel
            ends.append((piece.shard_offset, piece.shard_offset + piece.length))
            for k in range(piece.param_offset, piece.param_offset + piece.length):
                seen[piece.param_index][k] += 1
        ends.sort()
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # pieces never overlap
    assert all(c == 1 for counts in seen for c in counts)


@pytest.mark.parametrize("layout_cls", LAYOUTS, ids=lambda c: c.name)
@EXAMPLES
@given(shape_list=shapes, n=world_sizes)
def test_shard_gather_views_give_the_parameters_back(layout_cls, shape_list, n):
    tensors = _tensors(shape_list, seed=len(shape_list) * 7 + n)
    layout = layout_cls(shape_list, n)
    shards = []
    for r in range(n):  # each rank fills its shard from its pieces only
        shard, local = torch.zeros(layout.shard_numel), layout.local(r)
        for i, t in enumerate(tensors):
            piece = local.pieces.get(i)
            if piece:
                local.piece(shard, i).copy_(t.reshape(-1)[piece.param_offset :][: piece.length])
        shards.append(shard)
    gathered = torch.cat(shards) if shards else torch.zeros(0)  # what an all-gather makes
    views = layout.views(layout.from_wire(gathered))
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))
    # and back: the buffer a reduce-scatter reads holds each rank's pieces in its slot
    wire = layout.to_wire(layout.flatten(tensors))
    assert torch.equal(wire, gathered)


@pytest.mark.parametrize("layout_cls", LAYOUTS, ids=lambda c: c.name)
def test_views_share_the_buffer_they_compute_in(layout_cls):
    layout = layout_cls([(5, 3), (4,), (7, 2)], 3)
    compute = torch.zeros(layout.padded_numel)
    for v in layout.views(compute):
        v.fill_(1.0)
    assert compute.sum() == layout.numel  # every view writes into the buffer, padding stays 0


def test_rows_are_fsdp2s_chunks():
    """rows: rank r holds rows [r*c, (r+1)*c) of each parameter, c = ceil(d0 / N), as torch.chunk."""
    shapes_, n = [(37, 13), (5,), (2, 3)], 4
    layout = RowsLayout(shapes_, n)
    tensors = _tensors(shapes_)
    for r in range(n):
        for i, t in enumerate(tensors):
            chunks = torch.chunk(t, n) + (t[:0],) * n  # torch.chunk may give fewer than n
            lo, hi = layout.rows_of(i, r)
            assert torch.equal(t[lo:hi], chunks[r] if r < len(torch.chunk(t, n)) else t[:0])


def test_whole_gives_each_parameter_to_one_rank_balancing_greedily():
    shapes_ = [(100,), (60,), (50,), (30,), (25,)]
    layout = WholeLayout(shapes_, 2)
    # largest first, each to the rank holding fewer: 100 -> r0; 60, 50 -> r1 (110); 30 -> r0
    # (130); 25 -> r1 (135)
    assert layout.owner == [0, 1, 1, 0, 1]
    assert layout.shard_numel == 135 and layout.padding == 5
    for r in range(2):
        for piece in layout.pieces(r):
            assert piece.param_offset == 0 and piece.length == math.prod(shapes_[piece.param_index])


def test_whole_shows_empty_parameters_of_the_same_ndim_on_other_ranks():
    layout = WholeLayout([(4, 3), (2,)], 2)
    shard = torch.zeros(layout.shard_numel)
    shown = [[layout.exposed(layout.local(r).piece(shard, i), i, r, None) for i in range(2)]
             for r in range(2)]
    owner = layout.owner
    assert shown[owner[0]][0].shape == (4, 3) and shown[1 - owner[0]][0].shape == (0, 3)
    assert shown[owner[1]][1].shape == (2,) and shown[1 - owner[1]][1].shape == (0,)


def test_rows_refuses_a_zero_dim_parameter_by_name():
    with pytest.raises(ValueError, match="0-d parameter.*layout='flat'"):
        RowsLayout([(3,), ()], 2)
