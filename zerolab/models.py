"""Small models for the tests, the demo and the benchmarks.

- ``GPT``: a GPT-2-style decoder with tied input/output embeddings; its ``blocks`` are the
  natural units.
- ``UnevenMLP``: layers of awkward sizes (not divisible by 2, 3 or 4), one frozen layer
  and one layer that forward never uses.

``units(model)`` lists the sub-modules each model wants as units (bottom-up order), so a
test can shard the same units with ``zero.shard`` and with FSDP2's ``fully_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 96
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one parameter, two users

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def units(self) -> list[nn.Module]:
        return [*self.blocks, self]

    def batch(self, batch: int, generator: torch.Generator):
        idx = torch.randint(0, self.cfg.vocab, (batch, self.cfg.seq + 1), generator=generator)
        return idx[:, :-1], idx[:, 1:]

    @staticmethod
    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


@torch.no_grad()
def gpt_init(module: nn.Module) -> None:
    """GPT-2's initialisation, one module at a time (an ``init_fn`` for zero.init_parameters):
    N(0, 0.02) weights, zero biases, unit norms. The tied head re-draws the shared weight."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class UnevenMLP(nn.Module):
    """Sizes 13 -> 37 -> 29 -> 7, a frozen middle layer, and ``unused`` never called."""

    has_unused_parameters = True  # DDP needs find_unused_parameters=True

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 37)
        self.frozen = nn.Linear(37, 29)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(29, 11)
        self.hidden = nn.Sequential(nn.Linear(29, 23), nn.Tanh(), nn.Linear(23, 29))
        self.out = nn.Linear(29, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        return self.out(x + self.hidden(x))

    def units(self) -> list[nn.Module]:
        return [self.hidden, self]

    def batch(self, batch: int, generator: torch.Generator):
        return torch.randn(batch, 13, generator=generator), torch.randn(batch, 7, generator=generator)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)


class EncoderStack(nn.Module):
    """A stack of ``nn.TransformerEncoderLayer`` (torch's own attention and MLP)."""

    def __init__(self, dim: int = 24, layers: int = 2, seq: int = 6):
        super().__init__()
        self.seq, self.dim = seq, dim
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=40, dropout=0.0,
                                       batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        return [*self.layers, self]

    def batch(self, batch: int, generator: torch.Generator):
        x = torch.randn(batch, self.seq, self.dim, generator=generator)
        return x, torch.randint(0, 5, (batch, self.seq), generator=generator)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


class LoRALinear(nn.Module):
    """A frozen base ``Linear`` plus a trainable low-rank update ``B A`` (LoRA, Hu et al. 2021)."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # (LoRA starts B at 0; tests want gradients)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRAStack(nn.Module):
    """Fine-tuning: blocks of a frozen dim x dim base and a trainable rank-r adapter, and a
    trainable head. Each block is a unit whose parameters are mostly frozen."""

    def __init__(self, dim: int = 384, blocks: int = 8, rank: int = 8):
        super().__init__()
        self.dim = dim
        self.blocks = nn.ModuleList(LoRALinear(dim, rank) for _ in range(blocks))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def units(self) -> list[nn.Module]:
        return [*self.blocks, self]

    def batch(self, batch: int, generator: torch.Generator):
        return (torch.randn(batch, self.dim, generator=generator),
                torch.randn(batch, 4, generator=generator))

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)
