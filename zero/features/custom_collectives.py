"""FSDP2's custom collectives as a comm policy: ``set_custom_all_gather`` and its relatives.

FSDP2 lets a user replace a group's two collectives with its own ``AllGather`` /
``ReduceScatter`` objects (``_fully_shard/_fsdp_api.py``): ``allocate(size, dtype=, device=)``
says where a buffer lives (a memory pool, a process group's allocator), ``__call__(output_tensor,
input_tensor, group, [op,] async_op)`` issues the collective, called with FSDP2's arguments
(``_fsdp_collectives.py``; ``all_gather`` says why). Empty, this policy is zero's own
``FlatCollectives``, call for call; with an object:

    all_gather      shard (S,) -> wire = allocate((N*S,)) -> wire[slot] = shard (cast)
                    -> object(wire, wire[slot], group)   -> full = wire
    reduce_scatter  grad (N*S,) -> wire = allocate((N*S,)) = grad, out = allocate((S,))
                    -> object(out, wire, group, op)      -> grad[slot] = out

one copy more each way than zero's own (FSDP2 copies too), the price of the object's memory;
each is issued through ``CommContext.launch``, in the ledger like every collective. Also
``set_allocate_memory_from_process_group_for_comm`` (gloo has none: ``torch.empty``, as FSDP2)
and ``set_separate_reduce_scatter_group`` (not queued behind the all-gathers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from zero import api
from zero.comm.backend import OPS
from zero.comm.flat_collectives import FlatCollectives

_OWN = FlatCollectives()


@dataclass(frozen=True, eq=False, repr=False)
class CustomCollectives:
    """zero's ``CommPolicy`` around FSDP2's ``AllGather`` / ``ReduceScatter`` objects (frozen:
    FSDP2's setters give the unit a changed copy through ``Unit.use_comm``).

    Args:
        all_gather_comm, reduce_scatter_comm: FSDP2's objects, or None for zero's own.
        from_group: buffers from the process group's allocator (FSDP2's ``ProcessGroupAlloc*``).
        reduce_scatter_groups: shard group -> a group of its own for the reduce-scatter.
    """

    all_gather_comm: Any = None
    reduce_scatter_comm: Any = None
    from_group: bool = False
    reduce_scatter_groups: dict = field(default_factory=dict)  # (never written: replaced)
    in_place_ok: ClassVar[bool] = True  # the shard may be this rank's slot of the full buffer

    def __repr__(self) -> str:  # (how the ranks compare it: zero/surface/options.py)
        names = [type(c).__name__ for c in (self.all_gather_comm, self.reduce_scatter_comm)]
        return (f"CustomCollectives(all_gather={names[0]}, reduce_scatter={names[1]}, "
                f"from_group={self.from_group}, "
                f"separate_reduce_scatter={bool(self.reduce_scatter_groups)})")

    def _buffer(self, comm, size: int, like: torch.Tensor, group) -> torch.Tensor:
        """A (size,) buffer of ``like``'s dtype and device where ``comm`` (or the group) says."""
        if comm is not None and hasattr(comm, "allocate"):
            return comm.allocate((size,), dtype=like.dtype, device=like.device)
        if self.from_group:
            backend = group._get_backend(like.device)
            if backend.supports_tensor_alloc(like.device):
                return backend.allocate_tensor(size, dtype=like.dtype, device=like.device)
        return torch.empty(size, dtype=like.dtype, device=like.device)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, slot: slice, *,
                   in_place: bool, group, unit: str, phase: str, ctx: api.Comm):
        """``full`` (N*S,) from every rank's ``shard`` (S,); a handle (``FlatCollectives``')."""
        comm = self.all_gather_comm
        if (comm is None and not self.from_group) or ctx.alone(group):
            return _OWN.all_gather(full, shard, slot, in_place=in_place, group=group, unit=unit,
                                   phase=phase, ctx=ctx)
        group = group if group is not None else ctx.backend.world()  # (FSDP2 passes a group)
        wire = self._buffer(comm, full.numel(), full, group)
        mine = wire[slot]
        mine.copy_(shard)  # (a cast to the compute dtype, as zero's own does it)
        # (N*S,) <- (S,) per rank, in place: our slot of the object's buffer is the input
        if comm is None:
            work = ctx.all_gather(wire, mine, group=group, unit=unit, phase=phase, async_op=True)
        else:
            # Called as FSDP2 calls it (its default ``unshard_async_op``): on an accelerator a
            # collective returns once queued on the side stream; an object that copies out of
            # a buffer of its own after issuing relies on it having finished on return.
            work = ctx.launch("all_gather", wire, lambda: comm(
                output_tensor=wire, input_tensor=mine, group=group, async_op=False),
                group=group, unit=unit, phase=phase, async_op=True)
        return _Then(work, lambda: full.copy_(wire), full.device)

    def reduce_scatter(self, grad: torch.Tensor, slot: slice, *, op: str, group, unit: str,
                       phase: str, ctx: api.Comm):
        """``grad`` (N*S,) reduced over the ranks into ``grad[slot]`` (S,); a handle."""
        group = self.reduce_scatter_groups.get(group, group)
        comm = self.reduce_scatter_comm
        if (comm is None and not self.from_group) or ctx.alone(group):
            return _OWN.reduce_scatter(grad, slot, op=op, group=group, unit=unit, phase=phase,
                                       ctx=ctx)
        group = group if group is not None else ctx.backend.world()
        wire = self._buffer(comm, grad.numel(), grad, group)
        wire.copy_(grad)
        out = self._buffer(comm, slot.stop - slot.start, grad, group)
        # (N*S,) -> (S,): our slice of the reduction over the ranks, into the object's buffer
        if comm is None:
            work = ctx.reduce_scatter(out, wire, op=op, group=group, unit=unit, phase=phase,
                                      async_op=True)
        else:
            work = ctx.launch("reduce_scatter", wire, lambda: comm(  # (as FSDP2: no async_op)
                output_tensor=out, input_tensor=wire, group=group, op=OPS[op]),
                group=group, unit=unit, phase=phase, async_op=True)
        return _Then(work, lambda: grad[slot].copy_(out), grad.device)

    def all_reduce(self, tensor: torch.Tensor, *, op: str, group, unit: str, phase: str,
                   ctx: api.Comm) -> None:
        """HSDP's all-reduce over the replicas: zero's own (FSDP2 offers no object for it)."""
        _OWN.all_reduce(tensor, op=op, group=group, unit=unit, phase=phase, ctx=ctx)


class _Then:
    """On ``wait()``, the copy out on the side stream (``zero/comm/context.py``'s streams note)."""

    def __init__(self, work, copy_out, device: torch.device):
        self.work, self.copy_out = work, copy_out
        self.module = torch.get_device_module(device)
        self.stream = self.module.current_stream()  # the side stream it was issued from

    def wait(self):
        current = self.module.current_stream()
        with self.module.stream(self.stream):
            self.work.wait()  # (the side stream waits for the collective)
            self.copy_out()
        current.wait_stream(self.stream)
