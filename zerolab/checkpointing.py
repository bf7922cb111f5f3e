"""Activation checkpointing as the plan applies it to each block: whole, or selectively per op.

- ``full``: the block is recomputed in backward; it keeps only its input (torch's
  ``checkpoint_wrapper``, as torchtitan's ``FullAC`` and HF's gradient checkpointing).
- ``selective``: torchtitan's per-op policy (its ``SelectiveAC``,
  ``torchtitan/distributed/activation_checkpoint.py`` in 0.3.0), the setting of its published
  Llama 3.1 runs. Inside each block it keeps the outputs of the operators that are expensive
  to recompute, and recomputes every other operator (norms, activations, RoPE, residual
  adds) in backward. Kept: what torch's partitioner calls compute-intensive (``mm``, ``addmm``,
  ``bmm``, the fused attentions...), every ``scaled_dot_product_attention`` kernel, ``max``
  (the scale of low-precision training) and functional reduce-scatters and all-to-alls (so
  that nothing is communicated twice); except every second matmul, which is recomputed, to
  trade compute for memory. The count of matmuls starts again at each call of a block.

Where it differs from torchtitan's: the plan's fake CPU ranks dispatch attention to
``_scaled_dot_product_flash_attention_for_cpu``, which the policy keeps as it keeps the GPU's
flash kernel. torchtitan also keeps ``topk`` (so that its MoE router picks the same experts
when recomputed); transformers' Mixtral divides ``topk``'s output in place, which a kept
tensor must not be (torch raises), so here the router's choice is recomputed. torchtitan's
``force_recompute_mm_shapes_by_fqns`` (its router's gate) is not applied.
"""

from __future__ import annotations

import torch
import torch.nn as nn

aten = torch.ops.aten
MODES = ("full", "selective")


def _kept_ops() -> set:
    from torch._functorch.partitioners import get_default_op_list

    kept = {op.default for op in get_default_op_list().compute_intensive_ops}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                 "_scaled_dot_product_fused_attention_overrideable",
                 "_scaled_dot_product_flash_attention_for_cpu", "max", "linear"):
        if (op := getattr(aten, name, None)) is not None:
            kept.add(op.default)
    functional = torch.ops._c10d_functional
    kept |= {functional.reduce_scatter_tensor.default, functional.all_to_all_single.default}
    return kept


_MATMULS = (aten.mm.default, aten.linear.default)


def selective_policy():
    """A fresh policy for one call of a block: keep the costly ops' outputs but every second
    matmul's, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    kept, count = _kept_ops(), {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _MATMULS:
            count[mode] += 1
        if func in kept:
            if func in _MATMULS and count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpointed(block: nn.Module, mode: str) -> nn.Module:
    """``block`` wrapped so that backward recomputes it, whole (``full``) or all but the ops
    the selective policy keeps (``selective``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        return checkpoint_wrapper(block)
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return checkpoint_wrapper(
            block, context_fn=lambda: create_selective_checkpoint_contexts(selective_policy()))
    raise ValueError(f"activation checkpointing {mode!r}: choose one of {MODES}")
