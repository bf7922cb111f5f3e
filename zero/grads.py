"""The gradient half of a unit: accumulate, reduce-scatter, hand each parameter its piece.

A unit's gradient takes one road (``Unit`` in ``zero/unit.py`` is the parameter half):

    autograd -> unsharded.grad (N*S,)     the full flat gradient, complete at post-backward
             -> [no_sync: kept, summed over micro-batches in reduce_dtype]
             -> reduce-scatter (avg)       (N*S,) on every rank -> (S,): our slice of the mean
             -> p.grad for each parameter  a 1-D view of our piece of the reduced shard

Stages 2/3 start the reduce-scatter the moment a unit's gradient is complete (one in
flight: ``Root.reduce``); stage 1 starts them all at the end of backward. Either way the
end of backward (``Root._finish_backward``) hands the shards out, for every unit that
synchronised. Under ``no_sync`` a unit keeps its full gradient instead: autograd adds the
next micro-batch into it, or, when the compute dtype is not ``reduce_dtype`` (bf16 compute,
fp32 reduction), we add it into an fp32 buffer ourselves, as FSDP2 does.
"""

from __future__ import annotations

from typing import Any

import torch

from zero import comm


class GradientMixin:
    """State: ``_unsynced`` (micro-batches kept in reduce_dtype), ``_reduction`` (a
    reduce-scatter in flight), ``_grad_shard`` (reduced, not yet handed out), ``_used`` (which
    parameters got a gradient since the last hand-out)."""

    def init_gradients(self) -> None:
        self._unsynced: torch.Tensor | None = None
        self._reduction: Any = None  # (work, full gradient kept alive, shard)
        self._grad_shard: torch.Tensor | None = None
        self._used = [False] * len(self.params)

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
        grad, self.unsharded.grad = self.unsharded.grad, None  # the unit lets go of it
        if self._unsynced is not None:  # earlier micro-batches, in reduce_dtype
            if grad is not None:
                self._unsynced += grad
            grad, self._unsynced = self._unsynced, None
        if grad is None:
            return
        grad = grad.to(self.reduce_dtype)  # FSDP2's reduce_dtype: upcast before reducing
        shard = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        work = comm.reduce_scatter(shard, grad, op="avg", group=self.group, unit=self.name,
                                   phase="backward", async_op=True)
        self._reduction = (work, grad, shard)  # grad stays alive until the collective is done

    def wait_reduce(self) -> None:
        if self._reduction is None:
            return
        work, _, shard = self._reduction
        work.wait()
        self._reduction = None  # the full gradient is freed here
        self._grad_shard = shard  # one reduction per backward; assign_grads hands it out

    def assign_grads(self, used: list[bool]) -> None:
        """Give each used parameter its piece of the reduced gradient (accumulating)."""
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

    def discard_gradients(self) -> None:
        """Forget every gradient not yet handed out (a failed iteration)."""
        if self._reduction is not None:
            self._reduction[0].wait()  # every rank issued it: let it finish everywhere
        self.unsharded.grad = None
        self._unsynced = self._reduction = self._grad_shard = None
        self._used = [False] * len(self.params)
