"""The gradient half of a unit: accumulate, reduce-scatter, hand each parameter its piece.

A unit's gradient takes one road (``Unit`` in ``zero/core/unit.py`` is the parameter half, and
holds one ``Gradient`` as ``unit.grads``):

    autograd -> unsharded.grad (N*S,)     the full flat gradient, complete at post-backward
             -> [no_sync: kept, summed over micro-batches in reduce_dtype]
             -> reduce-scatter (avg)       (N*S,) on every rank -> (S,): our slice of the mean,
                                           in place, into our own slot of the full gradient
             -> p.grad for each parameter  a 1-D view of our piece of the reduced shard

When each reduce-scatter starts is the schedule's business (``zero/core/schedule.py``): stage
1, which keeps the full gradient anyway, lets them all fly at once; stages 2/3 keep one in
flight (stage 1 in mixed precision waits for the end of backward). The end of backward
(``Root.finish_backward``) hands the shards out, for every unit that synchronised. Under
``no_sync`` a unit keeps its full gradient instead: autograd adds the next micro-batch into
it, or, when the compute dtype is not ``reduce_dtype`` (bf16 compute, fp32 reduction), we add
it into an fp32 buffer ourselves, as FSDP2 does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from zero.comm.context import CommContext, finish
from zero.core.flat import LocalShard

if TYPE_CHECKING:
    from zero.core.config import MeshInfo, UnitConfig
    from zero.core.state import Controls


class Division(NamedTuple):
    """How the reduction divides: what to do to the gradient before the reduce-scatter, which
    reduce ops to use, and what to divide the reduced shard by after."""

    premul: float | None  # multiply by this first (FSDP2's PREMUL_SUM, which gloo lacks)
    pre: float | None  # divide by this first (fp16: part of the mean, against overflow)
    post: float | None  # divide the reduced shard by this
    op: str  # the reduce-scatter's op
    replicas_op: str  # HSDP's all-reduce over the replicas


def divide_factors(dtype: torch.dtype, n: int, replicas: int = 1, factor: float | None = None,
                   force_sum: bool = False) -> Division:
    """FSDP2's arithmetic for the mean over ``n`` ranks (times ``replicas``), bit for bit
    (``_get_gradient_divide_factors``). fp32/bf16: the collective's own average, or, with a
    ``factor`` (``set_gradient_divide_factor``), a sum of the gradients times 1/factor. Other
    dtypes (fp16) could overflow in the sum: divide by a power of two near sqrt(factor) before
    summing and by the rest after. ``force_sum`` (``set_force_sum_reduction_for_comms``): only
    sums on the wire, the whole division after."""
    overflow = dtype not in (torch.float32, torch.bfloat16)
    if not overflow and not force_sum:
        if factor is None:
            return Division(None, None, None, "avg", "avg")
        if factor == n:
            return Division(None, None, None, "avg", "sum")
        return Division(1 / factor, None, None, "sum", "sum")
    factor = float(n * replicas) if factor is None else factor
    if not overflow:
        return Division(None, None, factor, "sum", "sum")
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return Division(None, pre, factor / pre, "sum", "sum")


class Reduction(NamedTuple):
    """A reduce-scatter in flight, and what ending it needs. Its tensors stay referenced here
    until the computing stream has waited for it (``zero/comm/context.py``'s note on streams)."""

    work: Any  # its handle
    grad: torch.Tensor  # the full flat gradient in reduce_dtype; the shard lands in its slot
    division: Division  # what is left to do after the sum
    keep: bool  # stage 1: the full gradient is kept, the shard stays a view of its slot
    event: Any  # recorded on the reduce-scatter stream once issued (None on the CPU)


class Gradient:
    """One unit's gradient, from autograd's full flat ``.grad`` to the parameters' ``.grad``.

    Args:
        leaf: the unit's full flat parameter, where autograd accumulates the gradient.
        sharded_params: the unit's ``ShardedParam`` objects (``.sharded.grad`` set here).
        local: this rank's slot and pieces of the unit's layout.
        master: the unit's shard (its dtype and device are the parameters' ``.grad``'s).
        config: the unit's ``UnitConfig``: ``reduce_dtype`` (``MixedPrecision``), whether
            the stage keeps the full gradient (stage 1), the comm policy that reduce-scatters
            it, the offload policy that takes the reduced shard where the optimizer steps.
        mesh: the unit's ``MeshInfo``: its group, and HSDP's replicas if any.
        name: the unit's name, for the ledger. controls: the unit's ``Controls``, where
            FSDP2's gradient settings live (divide factor, HSDP's all-reduce, unused ones).
    """

    def __init__(self, leaf: torch.Tensor, sharded_params: list, local: LocalShard,
                 master: torch.Tensor, config: UnitConfig, mesh: MeshInfo, name: str,
                 controls: Controls):
        self.leaf, self.sharded_params = leaf, sharded_params
        self.local, self.master = local, master
        self.config, self.mesh, self.name, self.controls = config, mesh, name, controls
        self.reduce_dtype, self.keeps_full = config.reduce_dtype, config.keeps_full_gradient
        self.partial: torch.Tensor | None = None  # HSDP: reduced, not yet over the replicas
        self._partial_used: list | None = None  # which parameters got a gradient meanwhile
        self.unsynced: torch.Tensor | None = None  # no_sync micro-batches, in reduce_dtype
        self.reduction: Reduction | None = None  # a reduce-scatter in flight
        self.reduced: torch.Tensor | None = None  # the reduced shard, not yet handed out
        self.used = [False] * len(sharded_params)  # which got a gradient since the hand-out
        self._zero_markers: dict = {}  # param index -> the zero .grad a no_sync backward left
        self._seen_grads: list = []  # (param, its .grad, version) when it left them

    def use_config(self, config: UnitConfig) -> None:
        """The unit's new config (``Unit.use_comm``: another comm policy)."""
        self.config = config

    @property
    def params(self) -> list:
        return [sp.sharded for sp in self.sharded_params]

    def has_unsynced(self) -> bool:
        return self.leaf.grad is not None or self.unsynced is not None

    def mark_used(self, i: int, grad: torch.Tensor) -> None:
        """A tensor hook on parameter i's view: it got a gradient in this backward."""
        self.used[i] = True

    def keep_unsynced(self) -> None:
        """no_sync: keep this micro-batch's gradient for the next reduction."""
        grad = self.leaf.grad
        if grad is None or grad.dtype == self.reduce_dtype:
            return  # autograd adds the next micro-batch into the leaf's .grad itself
        self.leaf.grad = None
        if self.unsynced is None:
            self.unsynced = grad.to(self.reduce_dtype)
        else:
            self.unsynced += grad

    def start_reduce(self, ctx: CommContext) -> None:
        """Start reducing: (N*S,) full flat gradient -> (S,) this rank's shard of the mean,
        through ``ctx`` (the root's ``CommContext``), on its reduce-scatter stream.

        Asynchronous: backward goes on while it runs; ``wait_reduce`` ends it.
        """
        if self.reduction is not None:
            # A second part of this backward's gradient (the unit ran twice, each call under
            # reentrant checkpointing: each recompute runs a backward of its own). Its mean is
            # added to the first part's, as FSDP2 adds each reduction into the sharded .grad.
            self.wait_reduce(ctx)
        grad, self.leaf.grad = self.leaf.grad, None  # the unit lets go of it
        if self.unsynced is not None:  # earlier micro-batches, in reduce_dtype
            if grad is not None:
                self.unsynced += grad
            grad, self.unsynced = self.unsynced, None
        if grad is None:
            return
        kept = self.keeps_full and grad.dtype == self.reduce_dtype
        # The copy-in (an upcast, a reorder) on the computing stream, as FSDP2 makes it: its
        # memory is that stream's, and autograd's gradient may go at once.
        grad = grad.to(self.reduce_dtype)  # FSDP2's reduce_dtype: upcast before reducing
        grad = self.local.layout.to_wire(grad)  # (rows: rank-major, a copy; others: as it is)
        d = divide_factors(grad.dtype, self.mesh.world_size, self.mesh.replicas,
                           self.controls.divide_factor, self.controls.force_sum)
        if d.premul is not None:
            grad.mul_(d.premul)  # a divide factor of the user's: sum(g * 1/factor)
        if d.pre is not None:
            grad.div_(d.pre)  # fp16: half of the mean's division before the sum, half after
        # The collective on the reduce-scatter stream, beside the rest of backward; ``grad``
        # stays referenced by the reduction until the computing stream has waited for it.
        streams = ctx.streams(grad.device)
        with streams.use(streams.reduce_scatter):
            work = self.config.comm.reduce_scatter(grad, self.local.slot, op=d.op,
                                                   group=self.mesh.group, unit=self.name,
                                                   phase="backward", ctx=ctx)
            event = streams.reduce_scatter.record_event()
        # Stage 1 keeps every full gradient until the step anyway (gradients: Ψ, as in DDP);
        # stages 2/3 copy the slot out when it arrives and free the rest (not an upcast copy:
        # keeping it for one slot would cost the whole copy).
        self.reduction = Reduction(work, grad, d, kept, event)

    def wait_reduce(self, ctx: CommContext) -> None:
        if self.reduction is None:
            return
        work, grad, d, keep, event = self.reduction
        ctx.streams(grad.device).wait(event)
        finish(work)
        self.reduction = None  # (the computing stream has waited: its buffers may go)
        # Our slot, where the optimizer steps: kept as a view of the full gradient (stage 1),
        # or a copy that frees the full one, on the host under CPU offload (device -> host).
        shard = self.config.offload.to_host(grad[self.local.slot], self.name, keep=keep)
        if self._skips_replicas():  # (the note on HSDP's partial reductions below)
            self.partial = (shard.clone() if keep else shard) if self.partial is None else \
                self.partial.add_(shard)
            return
        if self.partial is not None:
            shard += self.partial
            self.partial = None
        self.mesh.reduce_replicas(shard, d.replicas_op, self.config.comm, self.name, ctx)  # HSDP
        if self.controls.all_reduce_hook is not None:
            self._run_all_reduce_hook(*self.controls.all_reduce_hook, shard, ctx)
        if d.post is not None and d.post != 1:
            shard.div_(d.post)
        if self.reduced is None:
            self.reduced = shard  # assign hands it out at the end of backward
        else:
            self.reduced += shard  # the part before it (see start_reduce)

    # [Note: HSDP's partial reductions] FSDP2's set_requires_all_reduce(False) (or
    # set_requires_gradient_sync) accumulates micro-batches over the replicas without their
    # all-reduce: each backward reduce-scatters within the shard group, and the shards are
    # summed here, in reduce_dtype, before any division; the first backward that all-reduces
    # adds them to its own and averages the sum over the replicas once. No .grad is handed
    # out meanwhile (FSDP2 hands none), and which parameters got a gradient is remembered.
    # On a 1-D mesh there are no replicas: the setting changes nothing, as in FSDP2.

    def _skips_replicas(self) -> bool:
        return not self.controls.requires_all_reduce and self.mesh.replicated

    def _run_all_reduce_hook(self, hook, stream, shard: torch.Tensor, ctx: CommContext) -> None:
        """FSDP2's all-reduce hook: on the reduced shard (after HSDP's all-reduce, before the
        division after the sum), on the stream given or the all-reduce stream."""
        streams = ctx.streams(shard.device)
        stream = stream if stream is not None else streams.all_reduce
        with streams.use(stream):
            hook(shard)
        streams.join(stream)

    def zeros_if_unused(self) -> None:
        """FSDP2's set_reduce_scatter_unused_params: a unit that got no gradient in this
        backward reduce-scatters zeros, so that every rank reduces alike and every parameter
        gets a gradient (zeros where no rank used it)."""
        reduced = self.has_unsynced() or self.reduction is not None or self.reduced is not None
        if self.controls.reduce_unused and self.leaf.requires_grad and not reduced:
            self.leaf.grad = torch.zeros(self.leaf.shape, dtype=self.leaf.dtype,
                                         device=self.leaf.device)

    def assign(self, used: list[bool]) -> None:
        """Give each used parameter its piece of the reduced gradient (accumulating)."""
        self._unmark()
        shard, self.reduced = self.reduced, None
        self.used = [False] * len(self.params)
        if self._partial_used is not None:
            used = [a or b for a, b in zip(used, self._partial_used)]
        if self.partial is not None:  # HSDP's all-reduce skipped: wait for the one that runs
            self._partial_used = used
            return
        self._partial_used = None
        if shard is None:
            return
        shard = shard.to(self.master.dtype)
        for i, sp in enumerate(self.sharded_params):
            if not used[i] and not (self.controls.reduce_unused and sp.sharded.requires_grad):
                continue  # unused everywhere: grad stays None, as in DDP
            # (None: this rank holds none of it, layout "whole"; its hooks still run, as an
            # optimizer's step runs on every rank: torchtune's step in a hook marks the unit)
            sp.accumulate_grad(self._exposed_piece(shard, i))

    # [Note: zero_grad under no_sync] DDP keeps a no_sync micro-batch's gradient in p.grad,
    # so opt.zero_grad() discards it. Ours waits in the unit's full flat gradient, which no
    # optimizer sees. So after such a backward every parameter without a gradient gets a zero
    # marker as its .grad (nothing is reduced yet), and the next forward discards the unsynced
    # gradient if zero_grad() (or anyone) replaced or zeroed any .grad since.

    def mark_unsynced(self) -> None:
        if not self.has_unsynced():
            return
        zeros = torch.zeros_like(self.master)
        for i, p in enumerate(self.params):
            g = self._exposed_piece(zeros, i) if p.requires_grad and p.grad is None else None
            if g is not None:
                p.grad = self._zero_markers[i] = g
        # (a DTensor's own version counter: in-place ops on it do not reach its local tensor's)
        self._seen_grads = [(p, p.grad, p.grad._version) for p in self.params
                            if p.grad is not None]

    def discard_if_zeroed(self) -> None:
        if any(p.grad is not g or g._version != v for p, g, v in self._seen_grads):
            self.discard()

    def _exposed_piece(self, shard: torch.Tensor, i: int):
        """Parameter i's piece of a shard-sized buffer, shown as its parameter is (a DTensor for
        ``rows``), or None where the layout gives it no gradient (``whole``, not the owner)."""
        g = self.local.piece(shard, i)
        if not g.numel() and not self.local.layout.empty_pieces_get_grads:
            return None
        return self.local.layout.exposed(g, i, self.local.rank, self.mesh.placement)

    def _unmark(self) -> None:
        for i, marker in self._zero_markers.items():
            if self.params[i].grad is marker:
                self.params[i].grad = None  # a marker is not a gradient
        self._zero_markers, self._seen_grads = {}, []

    def discard(self) -> None:
        """Forget every gradient not yet handed out (a failed iteration)."""
        if self.reduction is not None:
            finish(self.reduction.work)  # every rank issued it: let it finish everywhere
            # (the computing stream waits on the collective: the buffers may go)
        self.leaf.grad = None
        self.unsynced = self.reduction = self.reduced = self.partial = None
        self._partial_used = None
        self.used = [False] * len(self.params)
        self._unmark()
