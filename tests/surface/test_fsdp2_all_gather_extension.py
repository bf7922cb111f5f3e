"""FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) honoured.

A parameter whose tensor subclass defines the two decides what its all-gather sends and what
the forward computes with. Two test subclasses (written here, after torchao's float8 weight
wrapper) and torchao's float8 training itself are trained on FSDP2 and on ``zero.fully_shard``
(``zero/features/all_gather_extension.py``): losses, gradients and parameters are compared
with ``torch.equal`` after every step; the sharded parameters' local tensors are the subclass
on both; and zero's all-gather sends exactly the plain rows and what the subclass returns.
On main zero ignored the extension: with the bf16 one, 35 of 35 tensors differed.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import zero
from conftest import sample
from harness import run_ranks

aten = torch.ops.aten

# The ops whose results stay wrapped (torchao's list, and detach): what FSDP2 does to make
# the sharded parameter; everything else computes on the plain values underneath.
_KEEP = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
         aten.view.default, aten.as_strided.default, aten._to_copy.default, aten.split.Tensor,
         aten.clone.default, aten.detach.default, aten.alias.default}


class Wrapped(torch.Tensor):
    """An fp32 weight in a wrapper: computes as its plain values; gathers as it says."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func in _KEEP:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    def __repr__(self):
        return f"{type(self).__name__}({self._data})"


class SendsBF16(Wrapped):
    """Sends bf16; the forward computes with the bf16-rounded weights, upcast again.
    (FSDP2's five-argument ``fsdp_pre_all_gather``.)"""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if out is not None:  # refill what autograd may hold, without bumping its version
            out.data.copy_(data)
            return None
        full = data.to(param_dtype)
        return full, (full,)


class SendsInt8(Wrapped):
    """Sends int8 rows and a scale per row; the forward computes with q * scale. The
    metadata carries the quantization's range. (The one-argument ``fsdp_pre_all_gather``,
    torchao's.)"""

    def fsdp_pre_all_gather(self, mesh):
        top = 127
        scale = self._data.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / top
        q = (self._data / scale).round().clamp(-top, top).to(torch.int8)
        return (q, scale), ("int8", top)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        q, scale = outputs
        assert metadata == ("int8", 127), metadata  # (it came from this rank's pre)
        full = (q.to(torch.float32) * scale).to(param_dtype)
        if out is not None:
            out.data.copy_(full)
            return None
        return full, (full,)


class MLP(nn.Module):
    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def wrap_weights(model: nn.Module, cls) -> nn.Module:
    """Every Linear's weight in the subclass (the biases stay plain)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(cls(m.weight.detach().clone()))
    return model


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class Sent:
    """What zero's backend all-gathers: (dtype, elements) per call, while active."""

    def __init__(self):
        from zero.comm.backend import TorchBackend
        self.calls, self.owner = [], TorchBackend

    def __enter__(self):
        self.saved = self.owner.all_gather

        def all_gather(backend, output, input, group, async_op):
            self.calls.append((input.dtype, input.numel()))
            return self.saved(backend, output, input, group, async_op)
        self.owner.all_gather = all_gather
        return self

    def __exit__(self, *exc):
        self.owner.all_gather = self.saved


def _train(rank, n, cls_name, mp, stage):
    cls = {"bf16": SendsBF16, "int8": SendsInt8}[cls_name]
    mesh = init_device_mesh("cpu", (n,))
    policy = MixedPrecisionPolicy(*mp) if mp else MixedPrecisionPolicy()
    torch.manual_seed(0)
    base = Net()
    runs = []
    for name, fs in (("fsdp2", fully_shard),
                     ("zero", lambda m, **kw: zero.fully_shard(m, stage=stage, **kw)),
                     ("zero without the subclass", None)):
        model = copy.deepcopy(base)
        if fs is None:
            fs = zero.fully_shard
        else:
            wrap_weights(model, cls)
        for b in model.blocks:
            fs(b, mesh=mesh, mp_policy=policy)
        fs(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps, sent = [], Sent()
        for s in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
            with sent:
                loss = model(x.to(mp[0]) if mp else x).float().pow(2).mean()
                loss.backward()
            grads = {k: full(p.grad).clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            steps.append((loss.detach(), grads,
                          {k: full(p).detach().clone() for k, p in model.named_parameters()}))
        kinds = {k: (type(p.to_local()).__name__, type(full(p)).__name__)
                 for k, p in model.named_parameters()}
        runs.append((steps, kinds, sent.calls))
    (ref, ref_kinds, _), (ours, our_kinds, sent), (plain, _, _) = runs
    out = [f"{k}: local and full tensor {our_kinds[k]}, FSDP2's {ref_kinds[k]}"
           for k in ref_kinds if our_kinds[k] != ref_kinds[k]]
    for s, (a, b) in enumerate(zip(ref, ours)):
        if not torch.equal(a[0], b[0]):
            out.append(f"step {s}: loss {a[0].item()} != {b[0].item()}")
        out += [f"step {s}: {what} {k}" for what, i in (("grad", 1), ("param", 2))
                for k in a[i] if not torch.equal(a[i][k], b[i][k])]
    # (bf16 compute rounds every weight to bf16 anyway: there the bf16 subclass changes nothing)
    if torch.equal(ours[0][0], plain[0][0]) and not (mp and cls is SendsBF16):
        out.append("the subclass changed nothing: the forward did not use what it built")
    # Each block's all-gather: its weights as the subclass sends them (per rank: its rows),
    # its biases in the compute dtype; nothing else.
    itemsize = (mp[0] if mp else torch.float32).itemsize
    if cls is SendsBF16:
        weights = (16 * 8 + 8 * 16) // n * 2
    else:  # int8 rows and an fp32 scale per row
        weights = (16 * 8 + 8 * 16) // n + (16 + 8) // n * 4
    block = weights + (16 + 8) // n * itemsize
    sizes = [dtype.itemsize * numel for dtype, numel in sent]
    as_plain = (16 * 8 + 8 * 16 + 16 + 8) // n * itemsize  # what ignoring the subclass sends
    # (both blocks, at least once; bf16 compute and the bf16 subclass send the same bytes)
    if sizes.count(block) < 2 or (as_plain != block and as_plain in sizes):
        out.append(f"the blocks' all-gathers sent {sorted(set(sizes))} bytes, not {block}")
    return out


CASES = [("bf16", None, 3), ("int8", None, 3)]
EVERY = [(c, mp, stage) for c in ("bf16", "int8") for mp in (None, (torch.bfloat16,
                                                                    torch.float32))
         for stage in (1, 2, 3)]


@pytest.mark.parametrize("cls,mp,stage", sample(CASES, EVERY))
def test_a_subclass_decides_what_is_sent_and_computed_with_bitwise_fsdp2s(cls, mp, stage):
    assert run_ranks(_train, 2, cls, mp, stage) == [[], []]


@pytest.mark.full
def test_four_ranks():
    assert run_ranks(_train, 4, "int8", None, 3) == [[]] * 4


# ---- torchao's float8 training, with float8 all-gather -----------------------------------


def _float8(rank, n, n_steps, precompute):
    import warnings

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    warnings.filterwarnings("ignore", message=".*force_recompute_fp8_weight_in_bwd")
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    base = Net()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    runs = []
    for fs in (fully_shard, zero.fully_shard):
        model = convert_to_float8_training(copy.deepcopy(base), config=config)
        for b in model.blocks:
            fs(b, mesh=mesh)
        fs(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for s in range(n_steps):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * s + rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            grads = {k: full(p.grad).clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            if precompute:  # torchao's one all-reduce of every weight's amax, after the step
                precompute_float8_dynamic_scale_for_fsdp(model)
            steps.append((loss.detach(), grads,
                          {k: full(p).detach().clone() for k, p in model.named_parameters()}))
        runs.append((steps, {k: type(p.to_local()).__name__
                             for k, p in model.named_parameters()}))
    (ref, ref_kinds), (ours, our_kinds) = runs
    out = [f"{k}: local {our_kinds[k]}, FSDP2's {ref_kinds[k]}" for k in ref_kinds
           if our_kinds[k] != ref_kinds[k]]
    for s, (a, b) in enumerate(zip(ref, ours)):
        if not torch.equal(a[0], b[0]):
            out.append(f"step {s}: loss {a[0].item()} != {b[0].item()}")
        out += [f"step {s}: {what} {k}" for what, i in (("grad", 1), ("param", 2))
                for k in a[i] if not torch.equal(a[i][k], b[i][k])]
    return out


@pytest.mark.parametrize("precompute", sample([False], [False, True]))
def test_torchao_float8_training_with_float8_all_gather_is_bitwise_fsdp2s(precompute):
    pytest.importorskip("torchao.float8", reason="torchao is an optional extra")
    assert run_ranks(_float8, 2, 2, precompute, timeout=120) == [[], []]


class OnlyPre(Wrapped):
    def fsdp_pre_all_gather(self, mesh):
        return (self._data,), None


def _refusals(rank, n):
    from torch.distributed.fsdp import CPUOffloadPolicy
    mesh = init_device_mesh("cpu", (n,))
    out = {}
    cases = {"flat": (SendsBF16, dict(layout="flat")),
             "comm_policy": (SendsBF16, dict(comm_policy=zero.QuantizedWeights())),
             "offload": (SendsBF16, dict(offload_policy=CPUOffloadPolicy(pin_memory=False))),
             "only pre": (OnlyPre, {}),
             "hpZ": (SendsBF16, dict(secondary_group=[dist.new_group([r]) for r in range(n)][
                 rank]))}
    torch.manual_seed(0)
    model = zero.fully_shard(wrap_weights(MLP(), SendsBF16), mesh=mesh)
    for name, setting in (  # (the subclass gathers itself: what these set would go unused)
            ("custom all-gather", lambda: model.set_custom_all_gather(object())),
            ("allocate", lambda: model.set_allocate_memory_from_process_group_for_comm(True))):
        try:
            setting()
            out[name] = "accepted"
        except NotImplementedError as e:
            out[name] = str(e)
    for name, (cls, kw) in cases.items():
        torch.manual_seed(0)
        model = wrap_weights(MLP(), cls)
        try:
            if "comm_policy" in kw or "secondary_group" in kw:
                zero.shard(model, layout="rows", **kw)
            else:
                zero.fully_shard(model, mesh=mesh, **kw)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_what_cannot_serve_the_extension_refuses_naming_why():
    out = run_ranks(_refusals, 2)[0]
    assert "layout='rows'" in out["flat"] and "up.weight" in out["flat"]
    assert "comm_policy" in out["comm_policy"]
    assert "offload_policy" in out["offload"]
    assert "fsdp_post_all_gather" in out["only pre"]
    assert "set_custom_all_gather" in out["custom all-gather"], out["custom all-gather"]
    assert "set_allocate_memory_from_process_group_for_comm" in out["allocate"], out["allocate"]
    assert "hpZ" in out["hpZ"] and "up.weight" in out["hpZ"], out["hpZ"]


def test_the_subclass_form_is_a_sending_form_by_zeros_own_protocol():
    from zero import api
    from zero.features.all_gather_extension import SubclassForm
    assert api.mismatches(SubclassForm, api.SendingForm) == []

    class SendsOnly:  # (a SendingForm is a ParamForm too: what it extends is asked for)
        sends = True

        def inputs(self, mesh, padded_rows): ...
        def output(self, k, like, world_size): ...
        def arrived(self, param_dtype): ...
    assert api.mismatches(SendsOnly, api.SendingForm) == [
        "it lacks the method 'unsharded'", "it lacks the method 'free'"]
