"""Every seam of the mechanism, written down: exactly what the mechanism calls, and how.

FSDP2 keeps its policies and interfaces side by side in ``_fsdp_api.py``; these are ours. Each
is a ``typing.Protocol`` of the members the mechanism uses, with the signatures it calls them
with; ``zero.shard`` checks what it is given against them (``check``) and names what differs,
so a new idea is one new object written from this file alone (``tests/core/test_seam_toys.py``
writes one of each). Which idea goes through which seam: notes/15-where-ideas-go.md, "The
seams". mypy holds zero's own objects to their protocols (``tests/test_types.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol, Sequence, runtime_checkable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

# ---- values a layout returns -----------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """Rank r's slice ``[offset, offset + size)`` of the unit's (N*S,) buffer."""

    offset: int
    size: int


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_offset, param_offset + length)`` of flattened parameter ``param_index``,
    at ``[shard_offset, shard_offset + length)`` of one rank's shard."""

    param_index: int
    param_offset: int
    shard_offset: int
    length: int


# ---- what seams are handed -------------------------------------------------------------------


class Work(Protocol):
    """A collective in flight: its output is readable once ``wait()`` returns."""

    def wait(self) -> Any: ...


class Comm(Protocol):
    """The root's comm context (``zero/comm/context.py``), as a policy sees it: each collective
    recorded (``unit``, ``phase`` name it in the ledger), agreed in check mode, bounded in its wait,
    sent through the root's backend; with ``async_op`` it returns a handle, else it has ended."""

    @property
    def backend(self) -> Backend: ...  # its questions: ``global_rank``, ``world()``...
    def rank(self, group=None) -> int: ...
    def world_size(self, group=None) -> int: ...
    def alone(self, group=None) -> bool: ...  # a group of one rank: nothing to send
    def name_group(self, group, name: str) -> None: ...  # its name in the ledger
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, group, unit: str,
                   phase: str, async_op: bool = False) -> Any: ...
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, op: str, group,
                       unit: str, phase: str, async_op: bool = False) -> Any: ...
    def all_reduce(self, tensor: torch.Tensor, *, op: str, group, unit: str, phase: str,
                   async_op: bool = False) -> Any: ...
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, group, unit: str,
                   phase: str, async_op: bool = False) -> Any: ...
    def broadcast(self, tensor: torch.Tensor, *, src: int, group, unit: str, phase: str,
                  async_op: bool = False) -> Any: ...
    def launch(self, op: str, buffer: torch.Tensor, start, *, group, unit: str, phase: str,
               async_op: bool = False) -> Any: ...  # start() issues it (a custom object)


class ParamForm(Protocol):
    """What the module computes with for one parameter (``ShardedParam.form``), made of its
    view into the unit's full buffer: the view (``AsIs``), a DTensor on its tensor-parallel
    mesh (``Placement``), what its tensor subclass builds (``SubclassForm``), or a copy in its
    own strides (``Strided``); FSDP2's ``FSDPParam.init_unsharded_param``."""

    @property
    def sends(self) -> bool:
        """Whether it decides what its parameter sends in the all-gather (a ``SendingForm``)."""

    def unsharded(self, view: torch.Tensor) -> torch.Tensor: ...  # after each gather
    def free(self) -> None: ...  # the unit reshards: drop what it holds besides the buffer


class SendingForm(ParamForm, Protocol):
    """A form that decides what its parameter sends (FSDP2's all-gather extension), layout
    "rows" only: its inputs join the unit's one all-gather (``rows.py``'s ``gather_sending``),
    and what arrived goes into outputs it owns."""

    def inputs(self, mesh: DeviceMesh, padded_rows: int) -> list[torch.Tensor]: ...  # 1-D
    def output(self, k: int, like: torch.Tensor, world_size: int) -> torch.Tensor: ...  # (N, -1)
    def arrived(self, param_dtype: torch.dtype) -> None: ...  # the outputs are filled


class UnitView(Protocol):
    """What a schedule or an offload policy sees of a unit, read only (an attribute or a
    property will do): its name (its module path after the first forward), its modules, its
    sharded parameters (what the optimizer steps)."""

    @property
    def name(self) -> str: ...
    @property
    def modules(self) -> list[nn.Module]: ...
    @property
    def params(self) -> list[nn.Parameter]: ...


class Order(Protocol):
    """The units of a root in the order their forward ran (``Root.order``)."""

    units: list  # every unit under the root, in module order, the root first
    this_iteration: list  # forward so far, this iteration (the unit asking is the last)
    last_iteration: list  # the whole forward of the previous iteration
    post_forward: list  # this iteration's units in the order their forwards ended (backward's)


# ---- the seams -------------------------------------------------------------------------------


@runtime_checkable
class Layout(Protocol):
    """Which rank holds which element of a unit (``zero/core/flat.py``'s note). A layout is a
    class, made by the mechanism from the parameters' shapes and the world size."""

    name: str  # for messages only: the mechanism never tests it
    copies: bool  # the gathered (N*S,) buffer must be copied into the compute buffer
    empty_pieces_get_grads: bool  # a rank with no piece of a parameter gets an empty .grad
    exposes_dtensors: bool  # parameters shown as DTensors of their full shape (FSDP2's)
    whole_parameters: bool  # each parameter whole on one rank, in its own shape
    shapes: list[torch.Size]
    padded_numel: int  # N*S: the all-gather's buffer
    shard_numel: int  # S: one rank's slot of it

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int) -> None: ...
    def shard(self, rank: int) -> ShardInfo: ...  # the rank's slot of the (N*S,) buffer
    def pieces(self, rank: int) -> list[Piece]: ...  # what the rank holds of each parameter
    def views(self, compute: torch.Tensor) -> list[torch.Tensor]: ...  # the parameters in it
    def from_wire(self, wire: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor: ...
    def to_wire(self, compute: torch.Tensor) -> torch.Tensor: ...
    def exposed(self, piece: torch.Tensor, i: int, rank: int, placement) -> torch.Tensor: ...


@runtime_checkable
class CommPolicy(Protocol):
    """How a unit's flat buffers cross the ranks (``zero/comm/flat_collectives.py``). Each
    method starts its collective through ``ctx`` and returns a handle whose ``wait()`` leaves
    the output filled (or None: filled already); it may send other dtypes and shapes."""

    @property
    def in_place_ok(self) -> bool:
        """The shard may be this rank's slot of the full buffer (stages 1/2)."""

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, slot: slice, *,
                   in_place: bool, group, unit: str, phase: str, ctx: Comm) -> Work: ...
    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str, ctx: Comm) -> Work: ...
    def all_reduce(self, tensor: torch.Tensor, *, op: str, group, unit: str, phase: str,
                   ctx: Comm) -> None: ...


@runtime_checkable
class OffloadPolicy(Protocol):
    """Where a unit's shards live, how they cross to the compute device, and the policy's
    part of the optimizer step (``zero/features/offload.py``). ``units`` below are the units
    (``UnitView``) of the optimizer's parameters that use this policy, in its order."""

    @property
    def on_device(self) -> bool: ...  # the shard lives on the compute device (may sit inside
    # the full buffer); read only: a class attribute, an instance's, or a property will do

    def home(self, compute: torch.device) -> torch.device: ...
    def pinned(self, compute: torch.device) -> bool: ...
    def check(self, layout: type[Layout]) -> None: ...  # raise if it cannot serve it
    def to_device(self, shard: torch.Tensor, device: torch.device, unit: str,
                  phase: str) -> torch.Tensor: ...
    def to_host(self, shard: torch.Tensor, unit: str, keep: bool = False) -> torch.Tensor: ...
    def before_step(self, optimizer, units: list, args: tuple,
                    kwargs: dict) -> tuple | None: ...  # new (args, kwargs) for the call, or None
    def after_step(self, optimizer, units: list) -> None: ...
    def resident(self, optimizer, units: list) -> ContextManager: ...  # state in memory


@runtime_checkable
class Schedule(Protocol):
    """Which units to start gathering (prefetch) while ``unit`` computes its forward, or its
    backward. One per root (``zero/core/schedule.py``); the mechanism gathers what it is told."""

    def forward_prefetch(self, unit: UnitView, order: Order) -> Sequence[UnitView]: ...
    def backward_prefetch(self, unit: UnitView, order: Order) -> Sequence[UnitView]: ...


@runtime_checkable
class Backend(Protocol):
    """The collectives themselves (``zero/comm/backend.py``), the group explicit, held by the
    root's ``CommContext``. Optional: ``host_group(group)``, the same ranks for host metadata where
    ``group`` moves only device memory (``TorchBackend``'s; without it, it stays on ``group``)."""

    def rank(self, group=None) -> int: ...
    def world_size(self, group=None) -> int: ...
    def name(self, group=None) -> str: ...  # "gloo", "nccl", "fake" (a simulation)...
    def world(self) -> Any: ...  # the group of every rank
    def global_rank(self, group, group_rank: int) -> int: ...
    def all_gather(self, output, input, group, async_op: bool) -> Any: ...
    def reduce_scatter(self, output, input, op: str, group, async_op: bool) -> Any: ...
    def all_to_all(self, output, input, group, async_op: bool) -> Any: ...
    def all_reduce(self, tensor, op: str, group, async_op: bool) -> Any: ...
    def broadcast(self, tensor, src: int, group, async_op: bool) -> Any: ...
    def bounded_wait(self, group, op: str) -> str: ...  # "timeout", "thread" or "none"
    def default_device(self, group=None) -> torch.device: ...


# ---- checking an object against a protocol ----------------------------------------------------


def _members(protocol) -> tuple[list[str], list[str]]:
    """The attributes and methods ``protocol`` lists, its bases' included (not typing's)."""
    attributes: list[str] = []
    methods: list[str] = []
    for cls in protocol.__mro__:
        if cls.__module__ != protocol.__module__:  # (typing's Protocol, Generic, object)
            continue
        attributes += [n for n in cls.__dict__.get("__annotations__", {}) if n not in attributes]
        attributes += [n for n, v in vars(cls).items() if isinstance(v, property)
                       and n not in attributes]
        methods += [n for n, v in vars(cls).items()
                    if inspect.isfunction(v) and (not n.startswith("_") or n == "__init__")
                    and v.__name__ != "_no_init_or_replace_init" and n not in methods]
    return attributes, methods


def _accepts(have: inspect.Signature, want: inspect.Signature) -> str | None:
    """Why a method with signature ``have`` cannot be called as ``want`` says, or None."""
    params = list(have.parameters.values())
    star = any(p.kind is p.VAR_POSITIONAL for p in params)
    stars = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    wanted = [p for p in want.parameters.values() if p.name != "self"]
    by_position = [p for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    by_keyword = [p for p in wanted if p not in by_position]
    used = set()
    for i, w in enumerate(by_position):
        if i < len(positional):
            used.add(positional[i].name)
        elif not star:
            return f"it takes no argument {i + 1} ({w.name!r})"
    for w in by_keyword:
        if w.name in by_name:
            used.add(w.name)
        elif not stars:
            return f"it takes no keyword argument {w.name!r}"
    extra = [p.name for p in params if p.name not in used and p.default is p.empty
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if extra:
        return f"it requires {', '.join(repr(n) for n in extra)}, which the mechanism never passes"
    return None


def mismatches(obj, protocol, probe=None) -> list[str]:
    """How ``obj`` differs from ``protocol``, in words: members it lacks (on ``probe``, an
    instance of the class ``obj``, if given), and methods the mechanism could not call as the
    protocol says (arguments without a default go by position, the others by keyword)."""
    attributes, methods = _members(protocol)
    holder = obj if probe is None else probe
    out = [f"it lacks {n!r}" for n in attributes if not hasattr(holder, n)]
    for name in methods:
        if name == "__init__" and not inspect.isclass(obj):
            continue
        member = getattr(obj, name, None)
        if member is None or not callable(member):
            out.append(f"it lacks the method {name!r}")
            continue
        try:
            have = inspect.signature(member)
        except (TypeError, ValueError):  # (a builtin without a signature: trust it)
            continue
        if inspect.isclass(obj):  # an unbound function: drop self
            have = have.replace(parameters=list(have.parameters.values())[1:])
        want = inspect.signature(getattr(protocol, name))
        why = _accepts(have, want)
        if why is not None:
            shown = str(want).replace("(self, ", "(").replace("(self)", "()")
            out.append(f"{name}: {why} (the mechanism calls {name}{shown.split(' ->')[0]})")
    return out


def check(obj, protocol, what: str, *, is_class: bool = False) -> None:
    """Raise ``TypeError`` naming how ``obj`` (given as ``what``) differs from ``protocol``.
    ``is_class``: the seam takes a class (a layout), not an instance."""
    if inspect.isclass(obj) and not is_class:
        raise TypeError(f"{what} is the class {obj.__name__}, not an object: give an instance "
                        f"({obj.__name__}(...))")
    if is_class and not inspect.isclass(obj):
        raise TypeError(f"{what} must be a class (the mechanism makes one per unit from the "
                        f"parameters' shapes and the world size), got {type(obj).__name__}")
    probe = None
    if is_class:  # (what a layout holds is set in __init__: ask one made for two elements)
        try:
            probe = obj([(2,)], 1)
        except Exception as e:  # noqa: BLE001 - reported as what differs
            raise TypeError(f"{what} ({obj.__name__}) could not be made as the mechanism makes "
                            f"one, {obj.__name__}(shapes, world_size): {e}") from e
    wrong = mismatches(obj, protocol, probe)
    if wrong:
        name = obj.__name__ if inspect.isclass(obj) else type(obj).__name__
        raise TypeError(f"{what} ({name}) is not a {protocol.__name__}: {'; '.join(wrong)}. "
                        f"zero/api.py lists what a {protocol.__name__} has and how the "
                        "mechanism calls it; the built-in ones are examples to follow")
