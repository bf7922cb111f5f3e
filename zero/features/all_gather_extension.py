"""FSDP2's all-gather extension: a tensor subclass decides what is sent, and what is computed with.

FSDP2 describes a parameter's life in four tensors ([Note: FSDP tensors] in torch's
``_fsdp_param.py``): the sharded parameter, the all-gather inputs, the all-gather outputs and
the unsharded parameter, with

    all-gather inputs     = sharded.fsdp_pre_all_gather(mesh, ...)  -> (tensors, metadata)
    unsharded parameter   = sharded.fsdp_post_all_gather(outputs, metadata, param_dtype)

for a parameter whose (local) tensor is a subclass defining both. torchao's float8 training
uses it to send fp8 weights and to compute with the fp8 tensor it rebuilds; a plain tensor
sends its shard (in the compute dtype) and computes with what arrived. zero honours it so:

- At sharding the subclass's plain values (its one inner tensor, ``__tensor_flatten__``) go
  into the unit's shard as any parameter's, and the sharded parameter's local tensor is the
  subclass again, around this rank's rows of the shard (``__tensor_unflatten__``): the
  optimizer steps the shard through it (``dress``).
- The unit's all-gather (``SubclassGather``, a comm policy: ``zero/api.py``'s
  ``CommPolicy``) sends, in one collective, the plain parameters' rows in the compute dtype
  and each subclass parameter's ``fsdp_pre_all_gather`` inputs, as bytes when their dtypes
  differ (as FSDP2 packs them); never the subclass parameters' own rows.
- When it has arrived, each subclass parameter's outputs go to its ``fsdp_post_all_gather``:
  the first time to build the unsharded tensor, later with ``out=`` that tensor, refilled in
  place (autograd may hold it for backward), as FSDP2 calls it. The module computes with
  that tensor (``SubclassForm.unsharded``), and its gradient flows to the parameter's view
  into the unit's full buffer, whence it is reduced as every gradient of the unit is.
- When the unit reshards, the outputs and the tensors ``fsdp_post_all_gather`` named as its
  own are freed (storage resized to 0), as FSDP2 frees them.

Layout "rows" only (the sharded parameter is a DTensor whose local tensor is the subclass,
FSDP2's); not with tensor parallel, CPU offload or another comm policy for the weights
(``check`` refuses each by name).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from zero import api
from zero.comm.flat_collectives import FlatCollectives


def has_extension(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) defines FSDP2's all-gather extension."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather")


def check(names, layout: type[api.Layout], comm_policy: api.CommPolicy | None,
          offload: api.OffloadPolicy) -> None:
    """Raise, naming the parameter and what to do, if a parameter with the extension cannot
    be served here."""
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
        if not offload.on_device:
            raise ValueError(f"{what}: the all-gather extension is not served with an offload "
                             "policy here (FSDP2 copies the subclass to the device first); "
                             "leave offload_policy unset for this model")


def policy(comm_policy, params):
    """The unit's comm policy: ``SubclassGather`` around ``comm_policy`` if a parameter of
    ``params`` has the extension, else ``comm_policy`` itself."""
    return SubclassGather(comm_policy) if any(map(has_extension, params)) else comm_policy


def dress(unit, originals) -> None:
    """After the unit is made: each parameter with the extension shows the subclass around
    its rows, computes with what the subclass builds, and the unit's gather knows them."""
    gather = unit.config.comm
    if not isinstance(gather, SubclassGather):
        return
    c = unit.config  # FSDP2 hands a 5-argument fsdp_pre_all_gather its MixedPrecisionPolicy
    param_dtype = None if c.param_dtype == c.master_dtype else c.param_dtype
    mp_policy = MixedPrecisionPolicy(param_dtype,
                                     None if c.reduce_dtype == c.param_dtype else c.reduce_dtype,
                                     c.output_dtype, c.cast_inputs or param_dtype is None)
    for sp, orig in zip(unit.sharded_params, originals):
        if has_extension(orig):
            sp.form = SubclassForm(sp, orig, sp.locations[0][0], mp_policy)
            sp.form.local()  # the subclass around this rank's rows, from now on
    gather.unit = unit


def _allocated(t: torch.Tensor) -> None:
    """Give ``t`` its storage back after a free (FSDP2's ``alloc_storage``)."""
    if t.untyped_storage().size() != t.numel() * t.element_size():
        t.untyped_storage().resize_(t.numel() * t.element_size())


class _ComputesWith(torch.autograd.Function):
    """The identity from a parameter's view into the unit's full buffer to what its subclass
    built: the forward computes with ``built``, the gradient goes to the view."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor, built: torch.Tensor) -> torch.Tensor:
        return built.detach()  # (a new tensor object over the same data: autograd's output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SubclassForm:
    """One parameter with the extension: its inputs, outputs and unsharded tensor (FSDP2's
    ``all_gather_outputs``, ``_extensions_data`` and ``_unsharded_param``), made from its
    ``ShardedParam`` and ``orig``, the subclass; a 5-argument ``fsdp_pre_all_gather`` gets the
    ``module`` holding it and the unit's ``mp_policy`` (torch's ``MixedPrecisionPolicy``)."""

    def __init__(self, sp, orig, module: nn.Module, mp_policy):
        self.sp, self.module, self.mp_policy = sp, module, mp_policy
        self.cls = type(orig)
        self.inner, self.context = orig.__tensor_flatten__()
        self.shape = orig.shape  # FSDP2's orig_size, and its contiguous stride
        self.stride = torch.empty(orig.shape, device="meta").stride()
        self.sizes: list[torch.Size] = []  # each input's shape, this gather
        self.metadata = None
        self.outputs: list[torch.Tensor] = []  # (N * numel,) each, made once, refilled
        self.own: tuple = ()  # what fsdp_post_all_gather said it allocated
        self.built: torch.Tensor | None = None  # FSDP2's unsharded parameter

    def local(self) -> Any:  # (the subclass: its two methods are duck-typed)
        """The sharded parameter's local tensor: the subclass around this rank's rows (made
        again if the parameter was remade plain since: ``to_empty``, a load)."""
        p = self.sp.sharded
        if type(p._local_tensor) is not self.cls:
            rows = p._local_tensor
            p._local_tensor = self.cls.__tensor_unflatten__({self.inner[0]: rows}, self.context,
                                                            rows.size(), rows.stride())
        return p._local_tensor

    def inputs(self, mesh, padded_rows: int) -> list[torch.Tensor]:
        """What this rank sends: ``fsdp_pre_all_gather``'s tensors, flattened (FSDP2's
        ``all_gather_inputs``), its metadata kept for ``arrived``."""
        local = self.local()
        pre = local.fsdp_pre_all_gather
        if len(inspect.signature(pre).parameters) == 1:
            tensors, self.metadata = pre(mesh)
        else:
            tensors, self.metadata = pre(mesh, self.shape, self.stride, self.module,
                                         self.mp_policy)
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
        """Input k's (N, numel) output to fill, ``like`` it, made once and re-allocated after a
        free: on the computing stream, which reads it and alone frees it (the streams note in
        ``zero/comm/context.py``)."""
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


class SubclassGather:
    """A unit's comm policy when some of its parameters have the extension (module note):
    one all-gather of the plain rows and the subclasses' inputs; the reduction is
    ``inner``'s (zero's own when None)."""

    in_place_ok = False  # the send buffer is made here, never the full buffer's slot

    def __init__(self, inner: api.CommPolicy | None = None):
        # (Any, not api.CommPolicy, until zero/surface/fsdp2_module.py's ``_collectives``
        # says that the policy inside is its CustomCollectives)
        self.inner: Any = inner if inner is not None else FlatCollectives()
        self.unit: Any = None  # the Unit (rows: its layout's columns), bound by ``dress``

    def __repr__(self) -> str:
        return f"SubclassGather({self.inner!r})"

    def around(self, inner: api.CommPolicy) -> "SubclassGather":
        """This gather, its reduction ``inner``'s (policies are never changed: replaced)."""
        new = SubclassGather(inner)
        new.unit = self.unit
        return new

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, slot: slice, *,
                   in_place: bool, group, unit: str, phase: str, ctx: api.Comm) -> api.Work:
        """Fill ``full`` (N*S,) rank-major with every rank's plain rows, and each subclass
        parameter's outputs, from one all-gather of this rank's bytes."""
        layout, n = self.unit.layout, self.unit.mesh.world_size
        forms = {sp.index: sp.form for sp in self.unit.sharded_params
                 if isinstance(sp.form, SubclassForm)}
        mesh = self.unit.mesh.placement
        mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim == 2 else mesh  # (HSDP: the shard dim)
        wire = full.view(n, layout.shard_numel)
        sends: list[torch.Tensor] = []  # this rank's pieces, in order
        goes: list = []  # where every rank's piece goes: wire columns, or (form, k, input k)
        for i, (seg, chunk) in enumerate(zip(layout.seg, layout.chunk)):
            if i in forms:
                inputs = forms[i].inputs(mesh, layout.chunk_rows[i])
                sends += inputs
                goes += [(forms[i], k, t) for k, t in enumerate(inputs)]
            elif chunk:
                sends.append(shard[seg:seg + chunk].to(full.dtype))  # (the cast, as ever)
                goes.append(wire[:, seg:seg + chunk])
        mixed = len({t.dtype for t in sends}) > 1
        as_sent = [t.view(torch.uint8) if mixed else t for t in sends]
        send = torch.cat(as_sent) if as_sent else full.new_empty(0)
        got = send.new_empty(n * send.numel())
        # (B,) per rank -> (N*B,): the plain rows and the subclasses' inputs, in one
        work = ctx.all_gather(got, send, group=group, unit=unit, phase=phase, async_op=True)
        return _Arrived(work, send, got, goes, [t.numel() for t in as_sent], mixed,
                        forms, full.dtype, n)

    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str, ctx: api.Comm) -> api.Work:
        return self.inner.reduce_scatter(grad, slot, op=op, group=group, unit=unit,
                                         phase=phase, ctx=ctx)

    def all_reduce(self, tensor: torch.Tensor, *, op: str, group, unit: str, phase: str,
                   ctx: api.Comm) -> None:
        self.inner.all_reduce(tensor, op=op, group=group, unit=unit, phase=phase, ctx=ctx)


class _Arrived:
    """The all-gather in flight; ``wait()`` copies each piece where it goes (FSDP2's
    ``split_with_sizes_copy``) and hands the subclasses their outputs."""

    def __init__(self, work, send, got, goes, sizes, mixed, forms, param_dtype, n):
        self.work, self.send, self.got, self.goes = work, send, got, goes  # (alive till then)
        self.sizes, self.mixed, self.forms = sizes, mixed, forms
        self.param_dtype, self.n = param_dtype, n

    def wait(self):
        self.work.wait()
        if self.sizes:
            outs = [go if torch.is_tensor(go) else go[0].output(go[1], go[2], self.n)
                    for go in self.goes]
            outs = [t.view(torch.uint8) if self.mixed else t for t in outs]
            # (outputs autograd may hold for backward are refilled, not changed: FSDP2's way)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
                torch.split_with_sizes_copy(self.got.view(self.n, -1), self.sizes, dim=1,
                                            out=outs)
        for form in self.forms.values():
            form.arrived(self.param_dtype)
        self.send = self.got = self.goes = None
