"""zero.save / zero.load across the layouts (zero/core/flat.py, rows.py, whole.py), bitwise.

The checkpoint is FSDP2's layout whatever the model's (notes/08), so a flat model's checkpoint
loads into a rows or whole model and back, at another world size or stage too, and training
then goes on exactly as the saved one would have.
"""

import pytest
import torch

import zero
from compare import GPT
from harness import run_ranks
from zerolab.models import GPTConfig


def _model(stage, layout):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for unit in model.units():
        zero.shard(unit, stage=stage, layout=layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, rank, s):
    x, y = model.batch(4, torch.Generator().manual_seed(10 * s + rank))
    loss = model.loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _save(rank, n, path, stage, layout):
    model, opt = _model(stage, layout)
    for s in range(2):
        _step(model, opt, rank, s)
    zero.save(path, model, opt)
    after = [_step(model, opt, rank, s) for s in (2, 3)]  # what training would have done
    return after, zero.full_state_dict(model)


def _resume(rank, n, path, stage, layout):
    model, opt = _model(stage, layout)
    _step(model, opt, rank, 7)  # other values and state, to be replaced
    zero.load(path, model, opt)
    after = [_step(model, opt, rank, s) for s in (2, 3)]
    return after, zero.full_state_dict(model)


TRIPS = [  # (saved as: layout, stage, world size) -> (loaded into: layout, stage, world size)
    (("flat", 3, 2), ("rows", 3, 2)), (("rows", 2, 2), ("flat", 1, 2)),
    (("flat", 1, 2), ("whole", 3, 2)), (("whole", 3, 2), ("rows", 2, 2)),
]


@pytest.mark.parametrize("saved,loaded", TRIPS, ids=lambda t: "-".join(map(str, t)))
def test_a_checkpoint_moves_between_layouts_bitwise(saved, loaded, tmp_path):
    path = str(tmp_path / "ckpt")
    (l0, s0), *_ = run_ranks(_save, saved[2], path, saved[1], saved[0])
    (l1, s1), *_ = run_ranks(_resume, loaded[2], path, loaded[1], loaded[0])
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_rows_at_world_size_3_loads_what_flat_saved_at_2(tmp_path):
    """Across world sizes the sums over ranks change order: the parameters must arrive
    bitwise, the training after within the reduction-order bound (notes/07)."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, path, 3, "flat")
    saved = run_ranks(_load_only, 2, path, 3, "flat")[0]
    loaded = run_ranks(_load_only, 3, path, 3, "rows")[0]
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def _load_only(rank, n, path, stage, layout):
    model, opt = _model(stage, layout)
    zero.load(path, model, opt)
    return zero.full_state_dict(model)


class _Fused(torch.nn.Module):
    """A fused QKV like torchtitan's: its save hook reads the full shape, and may split it."""

    def __init__(self, split: bool):
        super().__init__()
        self.wqkv = torch.nn.Linear(8, 24)
        self.split, self.seen = split, []
        self.register_state_dict_post_hook(self._on_save)

    def forward(self, x):
        return self.wqkv(x)

    @staticmethod
    def _on_save(module, state_dict, prefix, local_metadata):
        w = state_dict[f"{prefix}wqkv.weight"]
        module.seen.append(tuple(w.shape[1:]))  # what torchtitan's hooks read
        if module.split:
            q, k, v = state_dict.pop(f"{prefix}wqkv.weight").reshape(3, 8, 8)
            state_dict.update({f"{prefix}wq.weight": q, f"{prefix}wk.weight": k,
                               f"{prefix}wv.weight": v})


def _hooked_save(rank, n, path, split):
    torch.manual_seed(0)
    model = _Fused(split)
    zero.shard(model, stage=3)
    try:
        zero.save(path, model)
    except ValueError as e:
        return str(e), model.seen
    return "saved", model.seen


def test_state_dict_hooks_see_full_shapes_and_a_transforming_hook_is_refused(tmp_path):
    said, seen = run_ranks(_hooked_save, 2, str(tmp_path / "a"), False)[0]
    assert said == "saved" and seen and all(s == (8,) for s in seen)
    said, _ = run_ranks(_hooked_save, 2, str(tmp_path / "b"), True)[0]
    assert "a state-dict hook of the model makes 'wq.weight'" in said and "layout='rows'" in said
