"""Properties of the flat layout (zero/core/flat.py), single process, with hypothesis."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero.core.flat import FlatLayout

# Shapes of up to 3 dims with sizes 0..6: 0-d (scalar) and empty parameters included.
shapes = st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3), min_size=1, max_size=6)
world_sizes = st.integers(1, 8)
EXAMPLES = settings(max_examples=500, deadline=None)


@EXAMPLES
@given(shapes, world_sizes)
def test_shards_are_equal_and_tile_the_padded_buffer(shape_list, n):
    layout = FlatLayout(shape_list, n)
    assert layout.padded_numel % n == 0
    assert layout.numel <= layout.padded_numel < layout.numel + n
    covered = []
    for r in range(n):
        info = layout.shard(r)
        assert info.size == layout.padded_numel // n
        covered.extend(range(info.offset, info.offset + info.size))
    assert covered == list(range(layout.padded_numel))  # in order: no gap, no overlap


@EXAMPLES
@given(shapes, world_sizes)
def test_pieces_cover_each_parameter_exactly_once(shape_list, n):
    layout = FlatLayout(shape_list, n)
    seen = [[0] * math.prod(s) for s in shape_list]
    for r in range(n):
        info = layout.shard(r)
        for piece in layout.pieces(r):
            assert piece.length > 0
            assert 0 <= piece.shard_offset and piece.shard_offset + piece.length <= info.size
            # the piece sits where the flat layout says the parameter's elements are
            flat_start = layout.offsets[piece.param_index] + piece.param_offset
            assert flat_start == info.offset + piece.shard_offset
            for k in range(piece.param_offset, piece.param_offset + piece.length):
                seen[piece.param_index][k] += 1
        indices = [p.param_index for p in layout.pieces(r)]
        assert len(indices) == len(set(indices))  # at most one piece per parameter per rank
    assert all(c == 1 for counts in seen for c in counts)


@EXAMPLES
@given(shapes, world_sizes, st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_flatten_shard_gather_unflatten_is_identity(shape_list, n, dtype):
    gen = torch.Generator().manual_seed(len(shape_list) * 31 + n)
    tensors = [(torch.randn(s, generator=gen) * 100).to(dtype) for s in shape_list]
    layout = FlatLayout(shape_list, n)
    flat = layout.flatten(tensors)
    shards = [flat[layout.shard(r).offset :][: layout.shard(r).size].clone() for r in range(n)]
    gathered = torch.cat(shards)  # what an all-gather produces
    assert torch.equal(gathered[layout.numel :], torch.zeros_like(gathered[layout.numel :]))
    for t, v in zip(tensors, layout.views(gathered)):
        assert v.shape == t.shape and v.dtype == t.dtype
        assert torch.equal(v, t)  # bitwise


@EXAMPLES
@given(shapes, world_sizes)
def test_views_alias_the_buffer_and_never_show_padding(shape_list, n):
    layout = FlatLayout(shape_list, n)
    flat = torch.full((layout.padded_numel,), -1.0)  # padding would show as -1
    flat[: layout.numel] = torch.arange(layout.numel, dtype=torch.float32)
    base = flat.untyped_storage().data_ptr()
    for i, v in enumerate(layout.views(flat)):
        assert v.untyped_storage().data_ptr() == base
        assert v.storage_offset() == layout.offsets[i]
        if v.numel():
            assert v.data_ptr() == base + 4 * layout.offsets[i]
            assert (v >= 0).all()  # no padding visible
            assert v.reshape(-1)[-1].item() < layout.numel
        v.add_(0)  # writable through the view
    views = layout.views(flat)
    if views and views[0].numel():
        views[0].reshape(-1)[0] = 1234.0
        assert flat[0].item() == 1234.0  # writes reach the buffer


def test_zero_parameters():
    layout = FlatLayout([], 4)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (0, 0, 0)
    assert layout.pieces(3) == [] and layout.views(torch.empty(0)) == []
