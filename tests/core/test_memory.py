"""Memory per rank, measured with torch's MemTracker (zerolab.trackers.ZeroMemTracker), 2 ranks.

The model has 8 equal blocks (units) and a small root, so "one unit" is one block.
"""

import pytest
import torch
from torch.distributed._tools.mem_tracker import _MemRefType as Ref
from torch.utils._python_dispatch import TorchDispatchMode

import zero
from conftest import sample
from harness import run_ranks
from zerolab.memory import model_state_bytes, schedule
from zerolab.trackers import MODEL_STATES, MODEL_STATES_AND_COMM, ZeroMemTracker
from zerolab.models import GPT, GPTConfig, LoRAStack

CPU = torch.device("cpu")


def _model(stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, dim=64, vocab=64, seq=16))
    for unit in model.units():
        zero.shard(unit, stage=stage)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, rank):
    x, y = model.batch(2, torch.Generator().manual_seed(rank))
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _measure(rank, n, stage):
    model, opt = _model(stage)
    _step(model, opt, rank)  # the optimizer state exists from here on
    with ZeroMemTracker(model, opt) as mt:
        _step(model, opt, rank)
    units = zero.units_of(model)
    return {
        "peaks": {str(k): v for k, v in mt.category_peaks[CPU].items()},
        "optimizer_state": mt.state_peaks[Ref.OPT],  # without the step's temporaries
        "psi": sum(u.layout.numel for u in units),
        "padded": sorted(u.layout.padded_numel for u in units),
        "root": units[0].layout.padded_numel,
    }


@pytest.mark.parametrize("stage,n", sample([(1, 2), (2, 2)], [(1, 2), (2, 2), (2, 4)]))
def test_stage2_holds_a_shard_and_one_unit_of_full_gradient_stage1_holds_all(stage, n):
    out = run_ranks(_measure, n, stage)[0]
    grad_peak, full_grad = out["peaks"][str(Ref.GRAD)], 4 * out["psi"]
    one_unit = 4 * out["padded"][-1]
    if stage == 2:
        # The gradient shards, plus one unit's full gradient at a time: it is reduce-scattered
        # in place (no separate output while in flight), its shard copied out when it arrives
        # (for that instant both exist), and it is waited for before the next unit's gradient
        # begins; the root, reduced last, waits with its own small gradient formed
        # (notes/04-stage2.md; test_the_schedule_predicts... counts it to the byte).
        root = 4 * out["root"]
        assert grad_peak <= full_grad / n + one_unit + one_unit / n + root, out
    else:
        # The whole gradient until the step, reduced in place into each rank's own slot of it:
        # the shards cost nothing more (a separate output would add full_grad / n).
        assert full_grad <= grad_peak <= 1.02 * full_grad, out
    # Both keep full parameters and a shard of Adam's state (8 bytes per element).
    assert out["peaks"][str(Ref.PARAM)] >= 4 * out["psi"]
    assert out["optimizer_state"] <= 1.10 * 8 * out["psi"] / n


class _UnshardedBytes(TorchDispatchMode):
    """After every op: the bytes of the units' unsharded buffers (those that reshard, and
    those that keep their parameters, like the root), and how many resharding units are
    unsharded at once; and each unit's bytes right after its forward."""

    def __init__(self, units):
        super().__init__()
        self.units, self.after_forward = units, []
        self.peak, self.most_units = 0, 0
        self.resharding = [u for u in units if u.reshard_after_forward]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = [u for u in self.resharding if u.unsharded.untyped_storage().nbytes()]
        self.most_units = max(self.most_units, len(live))
        self.peak = max(self.peak, sum(u.unsharded.untyped_storage().nbytes() for u in self.units))
        return out


def _stage3(rank, n):
    model, opt = _model(3)
    _step(model, opt, rank)
    units = zero.units_of(model)
    probe = _UnshardedBytes(units)
    for u in units:  # registered after zero's hook, so it sees the state after post_forward
        u.modules[0].register_forward_hook(
            lambda m, a, o, u=u: probe.after_forward.append((u.name, u.unsharded.untyped_storage().nbytes())))
    with ZeroMemTracker(model, opt) as mt, probe:
        _step(model, opt, rank)
    return {
        "states_peak": mt.category_peaks[CPU][MODEL_STATES],
        "unsharded_peak": probe.peak,
        "most_units": probe.most_units,
        "after_forward": probe.after_forward,
        "psi": sum(u.layout.numel for u in units),
        "kept_bytes": sum(4 * u.layout.padded_numel for u in units if not u.reshard_after_forward),
        "unit_bytes": sorted(4 * u.layout.padded_numel for u in probe.resharding),
    }


def test_stage3_frees_each_unit_after_forward_and_bounds_model_states():
    out = run_ranks(_stage3, 2)[0]
    after = dict(out["after_forward"])
    assert len(after) == 9 and after.pop("root") > 0  # the root keeps its parameters (FSDP2)
    assert set(after.values()) == {0}, out["after_forward"]  # every block: 0 bytes
    # The unit computing and the one being prefetched: two units, besides the kept root.
    two_units = sum(out["unit_bytes"][-2:])
    assert out["most_units"] == 2, out
    assert 0 < out["unsharded_peak"] <= out["kept_bytes"] + two_units, out
    # params + grads + AdamW state: (4 + 4 + 8) Ψ / N, plus two units' params and full grads
    bound = model_state_bytes(out["psi"], 2, stage=3, mixed_precision=False) + 2 * two_units
    assert out["states_peak"] <= 1.10 * bound, (out["states_peak"], bound)
    assert out["states_peak"] < model_state_bytes(out["psi"], 2, stage=2, mixed_precision=False)


def _lora(rank, n):
    torch.manual_seed(0)
    model = LoRAStack(dim=64, blocks=6, rank=4)
    for unit in model.units():
        zero.shard(unit, stage=3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, opt, rank)
    units = zero.units_of(model)
    probe = _UnshardedBytes(units)
    with ZeroMemTracker(model, opt) as mt, probe:  # torch's MemTracker: frozen parameters too
        _step(model, opt, rank)
    block_bytes = {}  # each block is two units: its trainable adapter and its frozen base
    for u in probe.resharding:
        name = u.name.removesuffix(" (frozen)")
        block_bytes[name] = block_bytes.get(name, 0) + 4 * u.layout.padded_numel
    return {
        "unsharded_peak": probe.peak, "most_units": probe.most_units,
        "kept_bytes": sum(4 * u.layout.padded_numel for u in units if not u.reshard_after_forward),
        "block_bytes": sorted(block_bytes.values()),
        "frozen_units": sum(u.name.endswith(" (frozen)") for u in units),
        "grad_peak": mt.category_peaks[CPU][Ref.GRAD],
        "trainable_bytes": sum(4 * p.numel() for p in LoRAStack(64, 6, 4).parameters()
                               if p.requires_grad),
    }


def test_frozen_parameters_at_stage3_reshard_when_their_backward_is_done():
    # A LoRA-style model: every block's base weight frozen. Its backward still reads the base
    # weight (for the input's gradient) after the block's gradient is complete; the hook on
    # the inputs' gradients frees the block then, so at most two blocks are gathered at once
    # (the one computing and the one prefetched), not all six. The frozen base is a unit of
    # its own (zero.shard splits it off): no gradient is formed, reduced or kept for it.
    out = run_ranks(_lora, 2)[0]
    assert out["frozen_units"] == 6, out
    assert out["most_units"] <= 4, out  # two blocks, each two units
    assert 0 < out["unsharded_peak"] <= out["kept_bytes"] + sum(out["block_bytes"][-2:]), out
    assert out["grad_peak"] <= 2 * out["trainable_bytes"], out  # gradients: the adapters only


def _schedule(rank, n, stage):
    model, opt = _model(stage)
    _step(model, opt, rank)
    with ZeroMemTracker(model, opt) as mt:
        _step(model, opt, rank)
    units = zero.units_of(model)
    predicted = schedule([u.layout.padded_numel for u in units], stage, n,
                         sum(len(u.params) for u in units))
    return mt.category_peaks[CPU][MODEL_STATES], predicted


@pytest.mark.parametrize("stage,n", sample([(1, 2), (2, 2), (3, 2)], [(s, n) for n in (2, 4) for s in (1, 2, 3)]))
def test_the_schedule_predicts_the_measured_model_state_peak_to_the_byte(stage, n):
    # zerolab/memory.py walks the paper's terms through our schedule, unit by unit, with the
    # extras the formula leaves out (padding, step counters, units in flight).
    for measured, predicted in run_ranks(_schedule, n, stage):
        assert measured == predicted["peak"], (measured, predicted)
        assert predicted["in_flight"] >= 0


# ---- a comm policy's buffers on the wire are comm buffers, as FSDP2's tracker files its own ---


def _wire(rank, n, policy):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, dim=64, vocab=64, seq=16))
    for unit in model.units():
        zero.shard(unit, stage=3, comm_policy=zero.QuantizedWeights() if policy else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, rank)
    with ZeroMemTracker(model, opt) as mt:
        _step(model, opt, rank)
    peaks = {getattr(k, "value", k): v for k, v in mt.category_peaks[CPU].items()}
    shard = max(u.layout.padded_numel for u in zero.units_of(model)) // n
    blocks = -(-shard // 256)  # qwZ's message a rank: int8 codes and fp32 scales by 256
    return peaks, blocks * 256 + 4 * blocks


def test_a_comm_policys_wire_buffers_are_comm_buffers_not_temporaries():
    for (qwz, message), (plain, _) in zip(run_ranks(_wire, 2, True), run_ranks(_wire, 2, False)):
        assert plain.get("All Gather", 0) == 0  # the default sends the units' own storage
        # qwZ's message and its gathered copy (N messages), for at most two units at once
        assert 0 < qwz["All Gather"] <= 2 * (1 + 2) * message
        assert plain[MODEL_STATES_AND_COMM] == plain[MODEL_STATES]
        assert qwz[MODEL_STATES] < qwz[MODEL_STATES_AND_COMM] <= qwz[MODEL_STATES] + qwz["All Gather"]
