"""layout="rows" is FSDP2's layout: bitwise FSDP2 at any world size, and FSDP2's surface.

Each rank holds its dim-0 chunk of every parameter, gathered and reduced in FSDP2's rank-major
buffer, so the sums over ranks happen in FSDP2's order (at world size 3 and 4 too, where the
flat layout is ulps away: notes/07-equality.md); and the parameters are Shard(0) DTensors, so
torch's own clip_grad_norm_ and DCP's state-dict functions see what they see on FSDP2.
"""

import os

import pytest
import torch
import torch.distributed as dist

import zero
from compare import GPT, EncoderStack, System, UnevenMLP
from conftest import sample
from harness import run_ranks
from zerolab.models import GPTConfig

MODELS = {"gpt": lambda: GPT(GPTConfig()), "mlp": UnevenMLP, "encoder": EncoderStack}


def _against_fsdp2(rank, n, model, stage, mp, steps=3):
    torch.manual_seed(0)
    base = MODELS[model]()
    ref = System("fsdp2" if stage == 3 else "fsdp2-noreshard", base, "adamw", mp=mp)
    ours = System(f"zero{stage}", base, "adamw", mp=mp, layout="rows")
    same = []
    for s in range(steps):
        a, _ = ref.step(rank, s)
        b, _ = ours.step(rank, s)
        same.append(torch.equal(a, b))
    full_ref, full_ours = ref.full_params(), ours.full_params()
    same.append(all(torch.equal(full_ref[k], full_ours[k]) for k in full_ref))
    return same


# In the suite, a sample of the matrix; ZERO_FULL=1 (or ZERO_ROWS_MATRIX=1) runs all of it:
# every model, world sizes 2, 3 and 4, stages 1-3 (1 and 2 against FSDP2 without reshard),
# fp32 and bf16 compute with fp32 reduction.
CASES = [("gpt", 3, 3, True), ("gpt", 4, 3, False), ("mlp", 2, 3, True), ("gpt", 3, 1, False)]
MATRIX = [(m, n, s, mp) for m in MODELS for n in (2, 3, 4) for s in (1, 2, 3)
          for mp in (False, True)]


@pytest.mark.parametrize("model,n,stage,mp", MATRIX if os.environ.get("ZERO_ROWS_MATRIX")
                         else sample(CASES, MATRIX))
def test_rows_is_bitwise_equal_to_fsdp2(model, n, stage, mp):
    assert all(run_ranks(_against_fsdp2, n, model, stage, mp, timeout=120)[0])


def _clip(rank, n):
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    ddp, ours = System("ddp", base, "adamw"), System("zero3", base, "adamw", layout="rows")
    for s in (ddp, ours):
        x, y = base.batch(4, torch.Generator().manual_seed(rank))
        base.loss(s.model(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ddp.model.parameters(), 1.0)
    norm = torch.nn.utils.clip_grad_norm_(ours.model.parameters(), 1.0)  # torch's, on DTensors
    got = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    ours_norm = zero.clip_grad_norm_(ours.model, float("inf"))  # and ours still works
    return (got - want).abs().item() / want.item(), float(ours_norm) > 0


def test_torchs_clip_grad_norm_gives_the_global_norm_on_every_rank():
    for rel, ok in run_ranks(_clip, 2):
        assert rel <= 1e-6 and ok


def _dcp_state_dicts(rank, n, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    ours, fsdp2 = System("zero3", base, "adamw", layout="rows"), System("fsdp2", base, "adamw")
    for s in (ours, fsdp2):
        s.step(rank, 0)
    # ours -> DCP -> FSDP2, as an FSDP2 user would write it
    state = {"model": get_model_state_dict(ours.model),
             "optim": get_optimizer_state_dict(ours.model, ours.opt)}
    dcp.save(state, checkpoint_id=tmp)
    target = {"model": get_model_state_dict(fsdp2.model),
              "optim": get_optimizer_state_dict(fsdp2.model, fsdp2.opt)}
    dcp.load(target, checkpoint_id=tmp)
    set_model_state_dict(fsdp2.model, target["model"])
    set_optimizer_state_dict(fsdp2.model, fsdp2.opt, target["optim"])
    # and back into a fresh rows model, then both train on identically
    torch.manual_seed(1)
    again = System("zero3", GPT(GPTConfig()), "adamw", layout="rows")
    again.step(rank, 0)  # some other state, to be overwritten
    back = {"model": get_model_state_dict(again.model),
            "optim": get_optimizer_state_dict(again.model, again.opt)}
    dcp.load(back, checkpoint_id=tmp)
    set_model_state_dict(again.model, back["model"])
    set_optimizer_state_dict(again.model, again.opt, back["optim"])
    losses = [[s.step(rank, k)[0] for k in (1, 2)] for s in (ours, fsdp2, again)]
    same = [all(torch.equal(a, b) for a, b in zip(losses[0], other)) for other in losses[1:]]
    return same


def test_dcp_state_dicts_move_between_rows_and_fsdp2_bitwise(tmp_path):
    path = str(tmp_path / "dcp")
    for same in run_ranks(_dcp_state_dicts, 2, path, timeout=120):
        assert same == [True, True]


def _init_reading_shapes(rank, n):
    """torchtitan's init_weights reads weight.shape[1:] (a fused QKV): on the meta device,
    sharded, then zero.init_parameters, it gives the full init's values."""
    def init_fn(module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=module.weight.shape[1] ** -0.5)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()  # embeddings (tied to the head), norms

    torch.manual_seed(0)
    full = GPT(GPTConfig())
    torch.manual_seed(5)
    for m in full.modules():
        init_fn(m)
    with torch.device("meta"):
        meta = GPT(GPTConfig())
    for unit in meta.units():
        zero.shard(unit, stage=3, layout="rows", device="cpu")
    torch.manual_seed(5)
    zero.init_parameters(meta, init_fn)
    got, want = zero.full_state_dict(meta), full.state_dict()
    shapes_ok = all(p.shape == want[k].shape for k, p in meta.named_parameters())
    return shapes_ok and all(torch.equal(got[k], want[k]) for k in want)


def test_meta_init_that_reads_full_shapes_equals_the_full_init():
    assert all(run_ranks(_init_reading_shapes, 2))


def _units_mixing_layouts(rank, n):
    model = UnevenMLP()
    zero.shard(model.hidden, stage=3, layout="rows")
    try:
        zero.shard(model, stage=3)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_one_layout_per_model():
    assert "use one layout for all units of a model" in run_ranks(_units_mixing_layouts, 2)[0]
