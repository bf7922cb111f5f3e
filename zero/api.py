"""Every seam of the mechanism, written down: what an object must have to be plugged in there.

FSDP2 keeps its policies and interfaces side by side in one file (``_fsdp_api.py``); these
are ours. Each is a ``typing.Protocol``: a layout, a comm policy, an offload policy, a
schedule or a backend is any object with these members, whatever its class. ``zero.shard``
checks the objects it is given against them (``check``) and names what is missing, so a new
idea is one new object, not a branch inside the core. notes/15-where-ideas-go.md says which
seam each kind of idea goes through, and which files it touches.

Where each is used:

============  ==========================================  ====================================
protocol      zero's own                                  read by
============  ==========================================  ====================================
Layout        ``FlatLayout``, ``RowsLayout``,             ``zero/core/unit.py``, ``grads.py``,
              ``WholeLayout`` (``zero/core/``)            ``hooks.py``; checkpoints; state dicts
CommPolicy    ``FlatCollectives`` (``zero/comm/``),       ``zero/core/unit.py`` (gather),
              ``QuantizedWeights``, ``QuantizedGradients``  ``grads.py`` (reduce), ``config.py``
OffloadPolicy ``OnDevice``, ``CPUOffload``                ``zero/core/unit.py``, ``grads.py``;
              (``zero/features/offload.py``), ``DiskOffload``      the step hook; checkpoints
Schedule      ``Schedule`` (``zero/core/schedule.py``)    ``zero/core/hooks.py``, ``root.py``;
                                                          ``zerolab/memory.py``
Backend       ``TorchBackend`` (``zero/comm/backend.py``),  ``zero/comm/`` only
              ``LoggingBackend`` (``zero/features/logging_backend.py``)
============  ==========================================  ====================================
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Layout(Protocol):
    """Which rank holds which element of a unit (``zero/core/flat.py``'s note). A layout class
    is made from the parameters' shapes and the world size: ``Layout(shapes, world_size)``."""

    name: str  # for messages only: the mechanism never tests it
    copies: bool  # the gathered (N*S,) buffer must be copied into the compute buffer
    empty_pieces_get_grads: bool  # a rank with no piece of a parameter gets an empty .grad
    exposes_dtensors: bool  # parameters shown as DTensors of their full shape (FSDP2's)
    whole_parameters: bool  # each parameter whole on one rank, in its own shape
    shapes: list[torch.Size]
    padded_numel: int  # N*S: the all-gather's buffer
    shard_numel: int  # S: one rank's slot of it

    def shard(self, rank: int) -> Any: ...  # the rank's ``ShardInfo(offset, size)``
    def pieces(self, rank: int) -> list: ...  # the ``Piece``s the rank holds
    def local(self, rank: int) -> Any: ...  # a ``LocalShard``: slot and pieces
    def views(self, compute: torch.Tensor) -> list[torch.Tensor]: ...
    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor: ...
    def from_wire(self, wire: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor: ...
    def to_wire(self, compute: torch.Tensor) -> torch.Tensor: ...
    def exposed(self, piece: torch.Tensor, i: int, rank: int, placement) -> torch.Tensor: ...


@runtime_checkable
class CommPolicy(Protocol):
    """How a unit's flat buffers cross the ranks (``zero/comm/flat_collectives.py``). Each
    method starts the collective and returns a handle whose ``wait()`` leaves the output
    filled; it may send other dtypes and shapes (ZeRO++'s quantized ones do)."""

    in_place_ok: bool  # the shard may be this rank's slot of the full buffer (stages 1/2)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, slot: slice, *,
                   in_place: bool, group, unit: str, phase: str) -> Any: ...
    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str) -> Any: ...
    def all_reduce(self, tensor: torch.Tensor, *, op: str, group, unit: str,
                   phase: str) -> None: ...


@runtime_checkable
class OffloadPolicy(Protocol):
    """Where a unit's shards live, how they cross to the compute device, and the policy's
    part of the optimizer step (``zero/features/offload.py``)."""

    on_device: bool  # the shard lives on the compute device (may sit inside the full buffer)

    def home(self, compute: torch.device) -> torch.device: ...
    def pinned(self, compute: torch.device) -> bool: ...
    def check(self, layout) -> None: ...  # raise if this layout cannot be served
    def to_device(self, shard: torch.Tensor, device: torch.device, unit: str,
                  phase: str) -> torch.Tensor: ...
    def to_host(self, shard: torch.Tensor, unit: str, keep: bool = False) -> torch.Tensor: ...
    def before_step(self, optimizer, units: list, args: tuple,
                    kwargs: dict) -> tuple | None: ...  # new (args, kwargs) for the call, or None
    def resident(self, optimizer, units: list) -> ContextManager: ...  # state in memory


@runtime_checkable
class Schedule(Protocol):
    """When units are gathered ahead of need (prefetch), and in which order gradients are
    reduced (``zero/core/schedule.py``). One per root."""

    prefetch: int  # how many units ahead (forward) and behind (backward) to gather
    order: list  # units in the order their forward ran, this iteration
    last_order: list  # the same, the previous iteration
    reduced: list  # units whose reduction started since the root's last forward

    def ahead(self, order: list, pos: int) -> list: ...  # gathered while order[pos] computes
    def behind(self, order: list, pos: int) -> list: ...  # gathered for backward, likewise
    def forward_started(self, unit, is_root: bool) -> None: ...
    def backward_started(self, unit) -> None: ...
    def reduce(self, unit) -> None: ...
    def defer_reshard(self, unit) -> None: ...
    def free_deferred(self, but) -> None: ...
    def finish_backward(self, synced: list) -> None: ...
    def wait_reductions(self, synced: list) -> None: ...
    def reset(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """The collectives themselves (``zero/comm/backend.py``): ``torch.distributed``'s, with
    the group explicit. Everything above it goes through one ``Backend`` object."""

    def rank(self, group=None) -> int: ...
    def world_size(self, group=None) -> int: ...
    def name(self, group=None) -> str: ...
    def world(self) -> Any: ...
    def global_rank(self, group, group_rank: int) -> int: ...
    def all_gather(self, output, input, group, async_op: bool) -> Any: ...
    def reduce_scatter(self, output, input, op: str, group, async_op: bool) -> Any: ...
    def all_to_all(self, output, input, group, async_op: bool) -> Any: ...
    def all_reduce(self, tensor, op: str, group, async_op: bool) -> Any: ...
    def broadcast(self, tensor, src: int, group, async_op: bool) -> Any: ...
    def bounded_wait(self, group, op: str) -> str: ...  # "timeout", "thread" or "none"
    def default_device(self, group=None) -> torch.device: ...


def missing(obj, protocol) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (attributes, methods), in order."""
    names = [n for n in protocol.__dict__.get("__annotations__", {})]
    names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return [n for n in names if not hasattr(obj, n)]


def check(obj, protocol, what: str) -> None:
    """Raise ``TypeError`` naming what ``obj`` (given as ``what``) lacks of ``protocol``."""
    lacks = missing(obj, protocol)
    if lacks:
        raise TypeError(f"{what} ({type(obj).__name__}) is not a {protocol.__name__}: it lacks "
                        f"{', '.join(lacks)} (zero/api.py lists what a {protocol.__name__} "
                        "has; the built-in ones are examples to follow)")
