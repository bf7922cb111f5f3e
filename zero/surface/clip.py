"""Gradient clipping by the global norm, when every rank holds only a shard of the gradients.

Sum |g|^p over the local pieces, all-reduce the sums, take the p-th root (the inf-norm: the
maxima); llm.c makes the same point about its ZeRO-1 norm. The 2-norm may differ from torch's
by an ulp or two (another order of sums), the inf-norm is exact (``notes/07-equality.md``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero import comm
from zero.core import placement, registry
from zero.core.registry import units_of
from zero.core.rows import local_tensor


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the gradients of ``model`` so their global ``norm_type``-norm is at most ``max_norm``.

    Args:
        model: a model whose parameters are all managed by ``zero.shard``.
        max_norm: the largest allowed norm.
        norm_type: p of the p-norm; ``float("inf")`` for the max-norm.
        error_if_nonfinite: raise if the global norm is nan or inf.

    Returns:
        The global norm of the gradients before clipping (a 0-d tensor), on every rank.
    """
    units = units_of(model)
    # (its norm sums over the data-parallel shards only: a tp-local one is part of a part)
    placement.refuse(units, "zero.clip_grad_norm_", "clip with torch.nn.utils."
                     "clip_grad_norm_(model.parameters(), max_norm), which reads the DTensor "
                     "gradients whole (group the parameters by mesh, as torchtitan does)")
    group = units[0].group  # the shard group: replicas (HSDP) hold equal shards
    ctx = units[0].root.context
    with comm.raising_together(units[0].all_group, ctx=ctx):
        loose = [n for n, p in model.named_parameters()
                 if not registry.is_piece(p) and not registry.is_ignored(p)]
        if loose:
            raise ValueError(f"parameters {loose} are not sharded: call zero.shard on the root "
                             "module")
    comm.agree(f"clip gradients to a {norm_type}-norm of {max_norm}",
               group=units[0].all_group, ctx=ctx,
               fix="Call zero.clip_grad_norm_ on every rank, with the same arguments")
    with_grad = [p for p in model.parameters() if p.grad is not None]
    grads = [local_tensor(p.grad) for p in with_grad if registry.is_piece(p)]  # (rows: this rank's)
    # ignored_params are whole on every rank: their share of the norm is counted once, after
    whole = [p.grad for p in with_grad if not registry.is_piece(p)]
    norm_type = float(norm_type)
    pieces = [g for g in grads if g.numel()]  # a rank may hold no element of a parameter
    local = _norm(pieces, norm_type) if pieces else torch.zeros(
        (), dtype=grads[0].dtype if grads else torch.float32, device=units[0].unsharded.device)
    if norm_type == float("inf"):
        # gloo's MAX drops a NaN unless rank 0 holds it: carry "is NaN" beside the maximum
        both = torch.stack([local, torch.isnan(local).to(local.dtype)])
        comm.all_reduce(both, op="max", group=group, unit="clip", phase="step", ctx=ctx)
        total = torch.where(both[1] > 0, torch.full_like(both[0], float("nan")), both[0])
    else:
        total = local**norm_type
        comm.all_reduce(total, op="sum", group=group, unit="clip", phase="step", ctx=ctx)
        total = total ** (1.0 / norm_type)
    if whole:
        own = _norm(whole, norm_type)
        total = (torch.maximum(total, own) if norm_type == float("inf")
                 else (total**norm_type + own**norm_type) ** (1.0 / norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} is {total.item()}; "
                           "set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads + whole:
        g.mul_(coef)
    return total


def _norm(tensors: list, norm_type: float) -> torch.Tensor:
    """The norm of ``tensors`` in torch's order: each tensor's norm, then the norm of those."""
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in tensors])
    return torch.linalg.vector_norm(norms, norm_type)
