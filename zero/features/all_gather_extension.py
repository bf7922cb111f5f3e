"""FSDP2's all-gather extension: a tensor subclass decides what is sent, and what is computed with.

    all-gather inputs     = sharded.fsdp_pre_all_gather(mesh, ...)  -> (tensors, metadata)
    unsharded parameter   = sharded.fsdp_post_all_gather(outputs, metadata, param_dtype)

([Note: FSDP tensors] in torch's ``_fsdp_param.py``; torchao's float8 training sends fp8.)
The subclass's one inner tensor sits in the unit's shard like any parameter's; ``SubclassForm``
serves it (``out=``, refilled in place; a reshard frees the outputs, as FSDP2 does). Layout
"rows" only (``check``). notes/16-layouts.md, "rows, composed".
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from zero import api
from zero.core.config import UnitConfig


def has_extension(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) defines FSDP2's all-gather extension."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather")


def check(names, layout: type[api.Layout], comm_policy: api.CommPolicy | None,
          offload: api.OffloadPolicy, secondary_group=None) -> None:
    """Raise, naming the parameter and the fix, if one with the extension cannot be served."""
    for name, p in names:
        if not has_extension(p):
            continue
        what = f"{name} is a {type(p).__name__} with fsdp_pre_all_gather"
        if isinstance(p, DTensor):
            raise ValueError(f"{what} on a tensor-parallel mesh: zero does not compose the "
                             "all-gather extension with tensor parallel yet; use FSDP2's "
                             "fully_shard for this model")
        if not (hasattr(p, "fsdp_pre_all_gather") and hasattr(p, "fsdp_post_all_gather")):
            raise ValueError(f"{name}: a tensor subclass using FSDP2's all-gather extension "
                             "must define both fsdp_pre_all_gather and fsdp_post_all_gather")
        n = len(inspect.signature(p.fsdp_pre_all_gather).parameters)
        if n not in (1, 5):
            raise ValueError(f"{what}({n} arguments): FSDP2 calls it with (mesh) or (mesh, "
                             "outer_size, outer_stride, module, mp_policy)")
        inner, _ = p.__tensor_flatten__() if hasattr(p, "__tensor_flatten__") else ([], None)
        if len(inner) != 1 or getattr(p, inner[0]).shape != p.shape or \
                getattr(p, inner[0]).dtype != p.dtype:
            raise ValueError(f"{what}: zero keeps its values in the unit's shard and rebuilds "
                             "the subclass around its rows, so it needs __tensor_flatten__ "
                             "naming one inner tensor of its shape and dtype (it names "
                             f"{inner}); use FSDP2's fully_shard for this one")
        if not hasattr(layout, "placing"):
            raise ValueError(f"{what}, which layout={layout.name!r} cannot show as FSDP2 "
                             "does (a DTensor whose local tensor is the subclass): use "
                             "layout='rows' (zero.fully_shard's default)")
        # (fully_shard's own policy with no custom all-gather: the subclass gathers, it may reduce)
        if comm_policy is not None and getattr(comm_policy, "all_gather_comm", False) is not None:
            raise ValueError(f"{what}: its all-gather is the subclass's to decide, so a "
                             f"comm_policy ({type(comm_policy).__name__}) cannot gather it too")
        if secondary_group is not None:
            raise ValueError(f"{what}: backward would gather it from the smaller group kept "
                             "after forward (hpZ, fully_shard(reshard_after_forward=<int>)), "
                             "which holds what was computed with, not what the subclass sends "
                             "(FSDP2 refuses it too); reshard to the whole group for this model "
                             "(reshard_after_forward=True), or leave secondary_group unset")
        if not offload.on_device:
            raise ValueError(f"{what}: the all-gather extension is not served with an offload "
                             "policy here (FSDP2 copies the subclass to the device first); "
                             "leave offload_policy unset for this model")


def forms(originals, config: UnitConfig) -> list:
    """Per parameter of a unit about to be built: how to make its ``SubclassForm``, or None."""
    param_dtype = None if config.param_dtype == config.master_dtype else config.param_dtype
    mp_policy = MixedPrecisionPolicy(
        param_dtype, None if config.reduce_dtype == config.param_dtype else config.reduce_dtype,
        config.output_dtype, config.cast_inputs or param_dtype is None)
    return [partial(SubclassForm, orig=orig, mp_policy=mp_policy) if has_extension(orig)
            else None for orig in originals]


def _allocated(t: torch.Tensor) -> None:
    """Give ``t`` its storage back after a free (FSDP2's ``alloc_storage``)."""
    if t.untyped_storage().size() != t.numel() * t.element_size():
        t.untyped_storage().resize_(t.numel() * t.element_size())


class _ComputesWith(torch.autograd.Function):
    """Identity from a parameter's view to what its subclass built; the gradient to the view."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor, built: torch.Tensor) -> torch.Tensor:
        return built.detach()  # (a new tensor object over the same data: autograd's output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SubclassForm:
    """One parameter with the extension (``zero/api.py``'s ``SendingForm``): its inputs, outputs
    and unsharded tensor (FSDP2's ``all_gather_outputs``, ``_extensions_data``,
    ``_unsharded_param``), from its ``ShardedParam`` and ``orig``, the subclass."""

    sends = True  # its inputs go in the unit's all-gather, not its rows

    def __init__(self, sp, orig, mp_policy):
        self.sp, self.module, self.mp_policy = sp, sp.locations[0][0], mp_policy
        self.cls = type(orig)
        self.inner, self.context = orig.__tensor_flatten__()
        self.shape = orig.shape  # FSDP2's orig_size, and its contiguous stride
        self.stride = torch.empty(orig.shape, device="meta").stride()
        self.sizes: list[torch.Size] = []  # each input's shape, this gather
        self.metadata = None
        self.outputs: list[torch.Tensor] = []  # (N * numel,) each, made once, refilled
        self.own: tuple = ()  # what fsdp_post_all_gather said it allocated
        self.built: torch.Tensor | None = None  # FSDP2's unsharded parameter
        self.local()  # the subclass around this rank's rows, from now on

    def local(self) -> Any:  # (the subclass: its two methods are duck-typed)
        """The subclass around this rank's rows (made again after ``to_empty``, a load)."""
        p = self.sp.sharded
        if type(p._local_tensor) is not self.cls:
            rows = p._local_tensor
            p._local_tensor = self.cls.__tensor_unflatten__({self.inner[0]: rows}, self.context,
                                                            rows.size(), rows.stride())
        return p._local_tensor

    def inputs(self, mesh, padded_rows: int) -> list[torch.Tensor]:
        """What this rank sends: ``fsdp_pre_all_gather``'s tensors, flattened; metadata kept."""
        local = self.local()
        pre = local.fsdp_pre_all_gather
        if len(inspect.signature(pre).parameters) == 1:
            tensors, self.metadata = pre(mesh)
        else:
            tensors, self.metadata = pre(mesh, self.shape, self.stride, self.module, self.mp_policy)
        padded = torch.Size([padded_rows, *local.shape[1:]])
        if local.shape != padded and any(t.shape != padded for t in tensors):
            shapes = [tuple(t.shape) for t in tensors]
            raise RuntimeError(
                f"{self.cls.__name__}.fsdp_pre_all_gather returned {shapes} "
                f"for rows {tuple(local.shape)} of a parameter {tuple(self.shape)} that does not "
                f"divide evenly: it must return the padded size {tuple(padded)} (FSDP2 asks "
                "the same), or shard the parameter evenly")
        self.sizes = [t.shape for t in tensors]
        return [t.reshape(-1) for t in tensors]

    def output(self, k: int, like: torch.Tensor, world_size: int) -> torch.Tensor:
        """Input k's (N, numel) output, made once, re-allocated on the computing stream."""
        if len(self.outputs) == k:
            self.outputs.append(like.new_empty(world_size * like.numel()))
        _allocated(self.outputs[k])
        return self.outputs[k].view(world_size, -1)

    def arrived(self, param_dtype: torch.dtype) -> None:
        """``fsdp_post_all_gather`` on the outputs: builds the unsharded tensor, then refills it."""
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.sizes))
        post = self.local().fsdp_post_all_gather
        if self.built is None:
            built, self.own = post(outputs, self.metadata, param_dtype)
            # the parameter's own shape out of what may be padded rows (FSDP2's as_strided)
            self.built = torch.as_strided(built, self.shape, self.stride, storage_offset=0)
        else:
            for t in self.own:  # (freed at the last reshard)
                _allocated(t)
            post(outputs, self.metadata, param_dtype, out=self.built)
        self.metadata = None

    def unsharded(self, view: torch.Tensor) -> torch.Tensor:
        """What the module computes with: what the subclass built, its gradient to ``view``."""
        assert self.built is not None, "(the unit is gathered before its module computes)"
        return _ComputesWith.apply(view, self.built)

    def free(self) -> None:
        """The unit reshards: the outputs and what post_all_gather allocated go (storage 0)."""
        for t in (*self.outputs, *self.own):
            t.untyped_storage().resize_(0)
