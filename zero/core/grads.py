"""The gradient half of a unit: accumulate, reduce-scatter, hand each parameter its piece.

    autograd -> unsharded.grad (N*S,)     the full flat gradient, complete at post-backward
             -> [no_sync: kept, summed over micro-batches in reduce_dtype]
             -> reduce-scatter (avg)       (N*S,) on every rank -> (S,): our slice of the mean,
                                           in place, into our own slot of the full gradient
             -> p.grad for each parameter  a 1-D view of our piece of the reduced shard

When each reduce-scatter starts is ``zero/core/reductions.py``'s; the end of backward
(``Root.finish_backward``) hands the shards out (notes/04-stage2.md).
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
    """How the reduction divides: before the reduce-scatter, its ops, and after."""

    premul: float | None  # multiply by this first (FSDP2's PREMUL_SUM, which gloo lacks)
    pre: float | None  # divide by this first (fp16: part of the mean, against overflow)
    post: float | None  # divide the reduced shard by this
    op: str  # the reduce-scatter's op
    replicas_op: str  # HSDP's all-reduce over the replicas


def divide_factors(dtype: torch.dtype, n: int, replicas: int = 1, factor: float | None = None,
                   force_sum: bool = False) -> Division:
    """FSDP2's ``_get_gradient_divide_factors``, bit for bit: the mean over ``n`` ranks (times
    ``replicas``); fp16 divides by a power of two near sqrt(factor) before the sum."""
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
    """A reduce-scatter in flight, its tensors held till waited (``zero/comm/context.py``)."""

    work: Any  # its handle
    grad: torch.Tensor  # the full flat gradient in reduce_dtype; the shard lands in its slot
    division: Division  # what is left to do after the sum
    keep: bool  # stage 1: the full gradient is kept, the shard stays a view of its slot
    event: Any  # recorded on the reduce-scatter stream once issued (None on the CPU)


class Gradient:
    """One unit's gradient, from autograd's full flat ``.grad`` (of ``leaf``) to the parameters'
    ``.grad``, in the dtype of ``master``, the unit's shard; ``name`` is the ledger's."""

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
        self.unsynced = grad.to(self.reduce_dtype) if self.unsynced is None else \
            self.unsynced.add_(grad)

    def start_reduce(self, ctx: CommContext) -> None:
        """Start reducing (N*S,) -> (S,) this rank's shard of the mean; ``wait_reduce`` ends it."""
        if self.reduction is not None:
            # (a unit run twice, reentrant checkpointing: the mean adds to the first's, as FSDP2's)
            self.wait_reduce(ctx)
        grad, self.leaf.grad = self.leaf.grad, None  # the unit lets go of it
        if self.unsynced is not None:  # earlier micro-batches, in reduce_dtype
            if grad is not None:
                self.unsynced += grad
            grad, self.unsynced = self.unsynced, None
        if grad is None:
            return
        kept = self.keeps_full and grad.dtype == self.reduce_dtype
        # (the copy-in on the computing stream, as FSDP2's: autograd's gradient may go at once)
        grad = grad.to(self.reduce_dtype)  # FSDP2's reduce_dtype: upcast before reducing
        grad = self.local.layout.to_wire(grad)  # (rows: rank-major, a copy; others: as it is)
        d = divide_factors(grad.dtype, self.mesh.world_size, self.mesh.replicas,
                           self.controls.divide_factor, self.controls.force_sum)
        if d.premul is not None:
            grad.mul_(d.premul)  # a divide factor of the user's: sum(g * 1/factor)
        if d.pre is not None:
            grad.div_(d.pre)  # fp16: half of the mean's division before the sum, half after
        streams = ctx.streams(grad.device)
        with streams.use(streams.reduce_scatter):
            work = self.config.comm.reduce_scatter(grad, self.local.slot, op=d.op,
                                                   group=self.mesh.group, unit=self.name,
                                                   phase="backward", ctx=ctx)
            event = streams.reduce_scatter.record_event()
        self.reduction = Reduction(work, grad, d, kept, event)

    def wait_reduce(self, ctx: CommContext) -> None:
        if self.reduction is None:
            return
        work, grad, d, keep, event = self.reduction
        ctx.streams(grad.device).wait(event)
        finish(work)
        self.reduction = None  # (the computing stream has waited: its buffers may go)
        # our slot: a view of the kept full gradient (stage 1), or a copy (to the host if offloaded)
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
        # (assign hands it out at the end of backward; a second part adds: start_reduce)
        self.reduced = shard if self.reduced is None else self.reduced.add_(shard)

    # [Note: HSDP's partial reductions] FSDP2's set_requires_all_reduce(False): shards summed here
    # in reduce_dtype, averaged over the replicas by the next all-reduce (notes/11-conformance.md).

    def _skips_replicas(self) -> bool:
        return not self.controls.requires_all_reduce and self.mesh.replicated

    def _run_all_reduce_hook(self, hook, stream, shard: torch.Tensor, ctx: CommContext) -> None:
        """FSDP2's all-reduce hook on the reduced shard, on the stream given or all-reduce's."""
        streams = ctx.streams(shard.device)
        stream = stream if stream is not None else streams.all_reduce
        with streams.use(stream):
            hook(shard)
        streams.join(stream)

    def zeros_if_unused(self) -> None:
        """FSDP2's set_reduce_scatter_unused_params: a unit with no gradient reduces zeros."""
        reduced = self.has_unsynced() or self.reduction is not None or self.reduced is not None
        if self.controls.reduce_unused and self.leaf.requires_grad and not reduced:
            self.leaf.grad = torch.zeros_like(self.leaf)

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
            # (None: this rank holds none of it, layout "whole"; its hooks still run)
            sp.accumulate_grad(self._exposed_piece(shard, i))

    # [Note: zero_grad under no_sync] A no_sync gradient waits in the flat gradient, which no
    # optimizer sees; so each parameter without a .grad gets a zero marker, and the next forward
    # discards the unsynced gradient if any .grad was replaced or zeroed since (notes/13).

    def mark_unsynced(self) -> None:
        if not self.has_unsynced():
            return
        zeros = torch.zeros_like(self.master)
        for i, p in enumerate(self.params):
            g = self._exposed_piece(zeros, i) if p.requires_grad and p.grad is None else None
            if g is not None:
                p.grad = self._zero_markers[i] = g
        # (a DTensor's own version counter: in-place ops on it do not reach its local tensor's)
        self._seen_grads = [(p, p.grad, p.grad._version) for p in self.params if p.grad is not None]

    def discard_if_zeroed(self) -> None:
        if any(p.grad is not g or g._version != v for p, g, v in self._seen_grads):
            self.discard()

    def _exposed_piece(self, shard: torch.Tensor, i: int):
        """Parameter i's piece shown as its parameter is, or None (``whole``, not the owner)."""
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
        self.leaf.grad = None
        self.unsynced = self.reduction = self.reduced = self.partial = self._partial_used = None
        self.used = [False] * len(self.params)
        self._unmark()
