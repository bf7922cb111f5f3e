"""ZeRO++'s qwZ: the weight all-gather in int8, one scale per block (Wang et al., "ZeRO++:
Extremely Efficient Collective Communication for Giant Model Training", 2023, section 3.1).

    shard (S,) fp32 -> q (S,) int8 + scales (S/B,) fp32 -> one message of bytes a rank
                    -> all-gather -> full (N*S,)

Only what is sent is lossy; it needs the shard apart from the full buffer (notes/17, "qwZ").
"""

from __future__ import annotations

import torch

from zero import api
from zero.comm.flat_collectives import FlatCollectives

BLOCK = 256  # elements per scale (ours; DeepSpeed's qwZ groups by a similar fixed size)


def quantize_rows(x: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric block quantization of each row: (R, L) -> (R, nb*B) int8 in [-levels, levels]
    and (R, nb) fp32 scales (a block's largest magnitude over ``levels``), zero-padded."""
    rows, length = x.shape
    nb = -(-length // block)
    if length % block == 0:
        padded = x.float()  # (no copy of an fp32 tensor: nothing below writes into it)
    else:
        padded = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
        padded[:, :length] = x
    blocks = padded.reshape(rows, nb, block)
    scale = blocks.abs().amax(dim=2) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block
    # A block with an inf or a NaN gets a NaN scale, so a loss scaler finds the overflow (a NaN's
    # amax is NaN, and NaN > 0 is False: the block would come out finite, and wrong).
    scale = torch.where(torch.isfinite(blocks).all(dim=2), scale, torch.full_like(scale, torch.nan))
    q = torch.round(blocks / scale[:, :, None]).nan_to_num_(0).clamp_(-levels, levels)
    return q.to(torch.int8).view(rows, -1), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, length: int) -> torch.Tensor:
    """(R, nb*B) int8 and (R, nb) scales -> (R, length) fp32."""
    rows, nb = scale.shape
    return (q.view(rows, nb, -1).float() * scale[:, :, None]).view(rows, -1)[:, :length]


class QuantizedWeights(FlatCollectives):
    """qwZ: int8 block-quantized all-gather; the reduce-scatter as ``FlatCollectives``'."""

    in_place_ok = False  # the gather rewrites every slot, ours too: the shard must be apart

    def __init__(self, block: int = BLOCK):
        if block < 1:
            raise ValueError(f"block must be at least 1 element, got {block}")
        self.block = block

    def __repr__(self) -> str:
        return f"QuantizedWeights(block={self.block})"

    def quantize(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S,) -> (nb*B,) int8 and (nb,) fp32 scales, the last block padded with zeros."""
        q, scale = quantize_rows(shard.view(1, -1), self.block, levels=127)
        return q.view(-1), scale.view(-1)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, slot: slice, *,
                   in_place: bool, group, unit: str, phase: str, ctx: api.Comm) -> api.Work:
        if in_place:
            raise ValueError("QuantizedWeights (qwZ) rewrites every rank's slot of the full "
                             "buffer with dequantized values: it needs the shard apart from it "
                             "(stage 3, or stages 1/2 with mp_policy)")
        q, scale = self.quantize(shard)
        n = full.numel() // shard.numel() if shard.numel() else 1
        # One message a rank, its codes then its scales as bytes: (nb*B + 4*nb,) per rank ->
        # (N, nb*B + 4*nb), one all-gather (one ring's latency, not two)
        message = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)])
        gathered = message.new_empty(n, message.numel())
        work = ctx.all_gather(gathered.view(-1), message, group=group, unit=unit, phase=phase,
                              async_op=True)
        return _Dequantized(work, gathered, full, n, shard.numel(), q.numel())


class _Dequantized:
    """The all-gather in flight; ``wait()`` dequantizes into the full buffer."""

    def __init__(self, work, gathered, full, n: int, size: int, codes: int):
        self.work, self.gathered, self.full = work, gathered, full
        self.n, self.size, self.codes = n, size, codes

    def wait(self):
        self.work.wait()
        rows = self.gathered
        codes = rows[:, : self.codes].view(torch.int8)
        scales = rows[:, self.codes:].contiguous().view(torch.float32)
        values = dequantize_rows(codes, scales, self.size)
        self.full.view(self.n, self.size).copy_(values)  # (cast to param dtype)
        self.gathered = None
