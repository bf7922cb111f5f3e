"""FSDP2's custom collectives as a comm policy: ``set_custom_all_gather`` and its relatives.

FSDP2 lets a user replace the two collectives of a parameter group with objects of its own
(``torch.distributed.fsdp._fully_shard._fsdp_api``'s ``AllGather`` and ``ReduceScatter``).
Each object answers two questions: where the buffer a collective reads and writes lives
(``allocate(size, dtype=, device=)``: a memory pool, a process group's own allocator), and
how the collective is issued (``__call__(output_tensor, input_tensor, group, [op,]
async_op)``). zero calls them with FSDP2's arguments: the all-gather with ``async_op=False``,
the reduce-scatter without it (on an accelerator both return once queued on their stream). FSDP2 calls them in ``_fsdp_collectives.py``: the all-gather into a buffer of
(N*S,) the object allocated, this rank's (S,) slot of it as the input (in place); the
reduce-scatter from an allocated (N*S,) copy of the gradient into an allocated (S,) output,
with a ``ReduceOp``.

zero's mechanism moves a unit's buffers through a comm policy (``zero/api.py``'s
``CommPolicy``), and this one is the adapter: ``zero.fully_shard`` gives every call one, and
FSDP2's methods give the unit a changed copy (``zero/surface/fsdp2_module.py``). Empty, it
is zero's own ``FlatCollectives``, call for call. With an object it does what FSDP2 does around the object:

    all_gather      shard (S,) -> wire = allocate((N*S,)) -> wire[slot] = shard (cast)
                    -> object(wire, wire[slot], group)   -> full = wire
    reduce_scatter  grad (N*S,) -> wire = allocate((N*S,)) = grad, out = allocate((S,))
                    -> object(out, wire, group, op)      -> grad[slot] = out

one copy more each way than zero's own, in place, collectives (FSDP2 copies in and out of
the object's buffers too), the price of the object's own memory. Each is issued through the
root's comm context (``CommContext.launch``): recorded in the ledger, agreed in check mode,
its wait bounded, like every other collective. Two more of FSDP2's settings live here,
because they are about the same two collectives: the buffers allocated by the process group
(``set_allocate_memory_from_process_group_for_comm``; gloo has no allocator of its own, and
both FSDP2 and this fall back to ``torch.empty`` there), and a process group of its own for
the reduce-scatter (``set_separate_reduce_scatter_group``), so that it need not queue behind
the all-gathers on one communicator.
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
    """zero's ``CommPolicy`` around FSDP2's ``AllGather`` / ``ReduceScatter`` objects. Frozen:
    FSDP2's setters give the unit a changed copy (``dataclasses.replace``, through
    ``Unit.use_comm``), and the unit's config, frozen too, is replaced with it.

    Args:
        all_gather_comm, reduce_scatter_comm: FSDP2's objects, or None for zero's own.
        from_group: allocate the buffers through the process group's allocator (where it
            has one: NCCL with a memory pool), as FSDP2's ``ProcessGroupAlloc*`` do.
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
        """``full`` (N*S,) from every rank's ``shard`` (S,); a handle whose ``wait()`` leaves
        it filled (``FlatCollectives.all_gather``'s contract)."""
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
    """A handle that, once its collective has ended, copies the result where zero reads it.

    The object's buffers were allocated on the side stream the collective was issued from
    (``zero/comm/context.py``'s note on streams): the copy out of them runs there too, so that
    they are last used where they were made and may go when this handle does; the computing
    stream then waits for that stream. (On the CPU every stream call does nothing.)"""

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
