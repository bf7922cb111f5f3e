"""The gradient half of a unit: accumulate, reduce-scatter, hand each parameter its piece.

A unit's gradient takes one road (``Unit`` in ``zero/unit.py`` is the parameter half):

    autograd -> unsharded.grad (N*S,)     the full flat gradient, complete at post-backward
             -> [no_sync: kept, summed over micro-batches in reduce_dtype]
             -> reduce-scatter (avg)       (N*S,) on every rank -> (S,): our slice of the mean,
                                           in place, into our own slot of the full gradient
             -> p.grad for each parameter  a 1-D view of our piece of the reduced shard

A unit's reduce-scatter starts the moment its gradient is complete (``Root.reduce``):
stage 1, which keeps the full gradient anyway, lets them all fly at once; stages 2/3 keep one
in flight (stage 1 in mixed precision waits for the end of backward: ``keeps_full_gradient``).
The end of backward (``Root._finish_backward``) hands the shards out, for every unit that
synchronised. Under ``no_sync`` a unit keeps its full gradient instead: autograd adds the
next micro-batch into it, or, when the compute dtype is not ``reduce_dtype`` (bf16 compute,
fp32 reduction), we add it into an fp32 buffer ourselves, as FSDP2 does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero import comm


def divide_factors(dtype: torch.dtype, n: int) -> tuple[float | None, float | None]:
    """How the mean over n ranks is taken. fp32/bf16: the collective's own average (None).
    Other dtypes (fp16) could overflow in the sum: FSDP2 divides by a power of two near
    sqrt(n) before summing and by the rest after; so do we, to match it bit for bit."""
    if dtype in (torch.float32, torch.bfloat16) or n == 1:
        return None, None
    pre = 1
    while n % pre == 0 and n / pre > pre:
        pre *= 2
    return pre, n / pre


class GradientMixin:
    """State: ``_unsynced`` (micro-batches kept in reduce_dtype), ``_reduction`` (a
    reduce-scatter in flight), ``_grad_shard`` (reduced, not yet handed out), ``_used`` (which
    parameters got a gradient since the last hand-out)."""

    def init_gradients(self) -> None:
        self._unsynced: torch.Tensor | None = None
        self._reduction: Any = None  # (work, full gradient, post-divide, keep the full one)
        self._grad_shard: torch.Tensor | None = None
        self._used = [False] * len(self.params)
        self._zero_markers: dict = {}  # param index -> the zero .grad a no_sync backward left
        self._seen_grads: list = []  # (param, its .grad, version) when it left them

    def has_unsynced_gradient(self) -> bool:
        return self.unsharded.grad is not None or self._unsynced is not None

    @property
    def keeps_full_gradient(self) -> bool:
        """Stage 1 keeps the full gradient until the step and reduces it in place, into its
        own slot, as soon as it is complete. Not through a cast: a bf16 gradient is reduced
        through an fp32 copy, after which it would serve nothing; so in mixed precision stage
        1 keeps every bf16 gradient whole until backward ends (the paper's 2Ψ), then reduces
        them one by one."""
        return (self.stage.keep_grads and self.reduce_dtype == self.param_dtype
                and self.reduce_dtype == self.sharded.dtype)

    def _replicas(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    def _mark_used(self, i: int, grad: torch.Tensor) -> None:
        self._used[i] = True

    def keep_unsynced_gradient(self) -> None:
        """no_sync: keep this micro-batch's gradient for the next reduction."""
        grad = self.unsharded.grad
        if grad is None or grad.dtype == self.reduce_dtype:
            return  # autograd adds the next micro-batch into unsharded.grad itself
        self.unsharded.grad = None
        if self._unsynced is None:
            self._unsynced = grad.to(self.reduce_dtype)
        else:
            self._unsynced += grad

    def reduce_grad(self) -> None:
        """Start reducing: (N*S,) full flat gradient -> (S,) this rank's shard of the mean.

        Asynchronous: backward goes on while it runs; ``wait_reduce`` ends it.
        """
        if self._reduction is not None:
            # A second part of this backward's gradient (the unit ran twice, each call under
            # reentrant checkpointing: each recompute runs a backward of its own). Its mean is
            # added to the first part's, as FSDP2 adds each reduction into the sharded .grad.
            self.wait_reduce()
        grad, self.unsharded.grad = self.unsharded.grad, None  # the unit lets go of it
        if self._unsynced is not None:  # earlier micro-batches, in reduce_dtype
            if grad is not None:
                self._unsynced += grad
            grad, self._unsynced = self._unsynced, None
        if grad is None:
            return
        kept = self.keeps_full_gradient and grad.dtype == self.reduce_dtype
        grad = grad.to(self.reduce_dtype)  # FSDP2's reduce_dtype: upcast before reducing
        pre, post = divide_factors(grad.dtype, self.world_size * self._replicas())
        if pre is not None:
            grad.div_(pre)  # fp16: half of the mean's division before the sum, half after
        # In place: our slice of the mean lands in our own slot of the full gradient, so while
        # the collective runs the unit holds one buffer, not the full gradient and a shard.
        work = comm.reduce_scatter(grad[self._slot], grad, op="avg" if pre is None else "sum",
                                   group=self.group, unit=self.name, phase="backward",
                                   async_op=True)
        # Stage 1 keeps every full gradient until the step anyway (gradients: Ψ, as in DDP);
        # stages 2/3 copy the slot out when it arrives and free the rest (not an upcast copy:
        # keeping it for one slot would cost the whole copy).
        self._reduction = (work, grad, post, kept)

    def wait_reduce(self) -> None:
        if self._reduction is None:
            return
        work, grad, post, keep = self._reduction
        work.wait()
        self._reduction = None
        shard = grad[self._slot] if keep else grad[self._slot].clone()  # frees the full one
        if self.replicate_group is not None:
            # HSDP: (S,) -> (S,), averaged over the replicas (the same shard of every replica)
            comm.all_reduce(shard, op="avg" if post is None else "sum",
                            group=self.replicate_group, unit=self.name, phase="backward")
        if post is not None and post != 1:
            shard.div_(post)
        if self._grad_shard is None:
            self._grad_shard = shard  # assign_grads hands it out at the end of backward
        else:
            self._grad_shard += shard  # the part before it (see reduce_grad)

    def assign_grads(self, used: list[bool]) -> None:
        """Give each used parameter its piece of the reduced gradient (accumulating)."""
        self._unmark()
        shard, self._grad_shard = self._grad_shard, None
        self._used = [False] * len(self.params)
        if shard is None:
            return
        shard = shard.to(self.sharded.dtype)
        for i, p in enumerate(self.params):
            if not used[i]:
                continue  # unused everywhere: grad stays None, as in DDP
            g = self._piece(shard, i)
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g

    # [Note: zero_grad under no_sync] DDP keeps a no_sync micro-batch's gradient in p.grad,
    # so opt.zero_grad() discards it. Ours waits in the unit's full flat gradient, which no
    # optimizer sees. So after such a backward every parameter without a gradient gets a zero
    # marker as its .grad (nothing is reduced yet), and the next forward discards the unsynced
    # gradient if zero_grad() (or anyone) replaced or zeroed any .grad since.

    def mark_unsynced(self) -> None:
        if not self.has_unsynced_gradient():
            return
        zeros = torch.zeros_like(self.sharded)
        for i, p in enumerate(self.params):
            if p.requires_grad and p.grad is None:
                p.grad = self._piece(zeros, i)
                self._zero_markers[i] = p.grad
        self._seen_grads = [(p, p.grad, p.grad._version) for p in self.params
                            if p.grad is not None]

    def discard_gradients_if_zeroed(self) -> None:
        if any(p.grad is not g or g._version != v for p, g, v in self._seen_grads):
            self.discard_gradients()

    def _unmark(self) -> None:
        for i, marker in self._zero_markers.items():
            if self.params[i].grad is marker:
                self.params[i].grad = None  # a marker is not a gradient
        self._zero_markers, self._seen_grads = {}, []

    def discard_gradients(self) -> None:
        """Forget every gradient not yet handed out (a failed iteration)."""
        if self._reduction is not None:
            self._reduction[0].wait()  # every rank issued it: let it finish everywhere
        self.unsharded.grad = None
        self._unsynced = self._reduction = self._grad_shard = None
        self._used = [False] * len(self.params)
        self._unmark()
