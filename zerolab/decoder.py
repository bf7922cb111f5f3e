"""A small decoder written the way Hugging Face ``transformers`` writes its models.

The models in ``zerolab/models.py`` are plain; real model code does things that a sharding
library must survive, and this one does them on purpose:

- **checkpointing inside ``forward``**: with ``gradient_checkpointing`` on, the decoder layer
  (a unit) calls ``torch.utils.checkpoint.checkpoint`` on its own body, reentrant or not, so
  the recomputation happens inside the unit, in backward (transformers'
  ``GradientCheckpointingLayer`` does the same around the layer's call);
- **dataclass outputs**: the model returns a ``CausalLMOutput`` (transformers'
  ``CausalLMOutput``/``MoeCausalLMOutputWithPast``), not a tensor;
- **a tied head**: ``lm_head.weight`` is ``embed_tokens.weight`` (``tie_word_embeddings``);
- **a mixture of experts with one ``nn.Module`` per expert** (Mixtral's sparse block): a
  router picks the top-k experts per token and only experts that received tokens run
  (``skip_empty_experts``, transformers' current ``expert_hit`` loop), so an expert that no
  token of this rank chose gets no gradient on this rank while another rank's tokens use it.
  With ``skip_empty_experts=False`` every expert runs, on zero tokens if need be (the older
  Mixtral loop): every parameter is then used on every rank;
- RMSNorm computed in fp32 (``LlamaRMSNorm``), rotary position embeddings computed once by the
  model and passed to every layer, grouped-query attention, a gated (SwiGLU) MLP, and a
  router load-balancing loss (``aux_loss``) returned beside the logits.

It has the ``units()``/``batch()``/``loss()`` interface of ``zerolab/models.py``, so
``zerolab.systems.System`` builds DDP, FSDP2 and our stages from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class DecoderConfig:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: each key/value head serves heads // kv_heads
    hidden: int = 32  # the gated MLP's (and each expert's) inner size
    layers: int = 2
    experts: int = 8  # layers with an odd index use a mixture of experts; 0: none
    top_k: int = 1  # with 16 tokens a rank, about one expert in eight gets none
    skip_empty_experts: bool = True
    aux_loss_coef: float = 0.01
    gradient_checkpointing: bool = False
    use_reentrant: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-6


@dataclass
class CausalLMOutput:
    """What the model returns, like transformers' ``MoeCausalLMOutputWithPast``."""

    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """``LlamaRMSNorm``: normalise in fp32 whatever the input dtype, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    """Rotary position embeddings: (cos, sin) for the positions, in the activations' dtype."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq, dtype=torch.float32, device=x.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); also one expert of the mixture."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Mixtral's sparse block: top-k routing over per-expert modules.

    Returns the output and the router logits (for the load-balancing loss). ``last_counts``
    keeps how many tokens each expert got in the last forward, so a test can check that
    some expert went without tokens on some rank.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k, self.skip_empty = cfg.top_k, cfg.skip_empty_experts
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(cfg.dim, cfg.hidden) for _ in range(cfg.experts))
        self.last_counts: list[int] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.router(flat)
        weights = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        # (experts, top_k, tokens): which tokens chose each expert, in which slot
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        self.last_counts = mask.sum(dim=(1, 2)).tolist()
        for e, expert in enumerate(self.experts):
            if self.skip_empty and self.last_counts[e] == 0:
                continue  # no token chose it: it does not run, and gets no gradient here
            slot, token = torch.where(mask[e])
            y = expert(flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(flat.dtype))
        return out.reshape(b, t, d), logits


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (or mixture of experts), checkpointed from inside forward."""

    def __init__(self, cfg: DecoderConfig, moe: bool):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SparseMoE(cfg) if moe else GatedMLP(cfg.dim, cfg.hidden)

    def forward(self, x: torch.Tensor, position_embeddings):
        if self.cfg.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, position_embeddings,
                              use_reentrant=self.cfg.use_reentrant)
        return self._forward(x, position_embeddings)

    def _forward(self, x: torch.Tensor, position_embeddings):
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings)
        h = self.mlp(self.post_attention_layernorm(x))
        h, router_logits = h if isinstance(h, tuple) else (h, None)
        return x + h, router_logits


class Decoder(nn.Module):
    """The causal LM: embeddings, layers, final norm and the tied head (see the module note)."""

    has_unused_parameters = True  # DDP: experts without tokens on a rank get no gradient there

    def __init__(self, cfg: DecoderConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.rotary = Rotary(cfg.dim // cfg.heads, cfg.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, moe=cfg.experts > 0 and i % 2 == 1) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        x = self.embed_tokens(input_ids)
        position_embeddings = self.rotary(x, input_ids.shape[1])
        router_logits = []
        for layer in self.layers:
            x, logits = layer(x, position_embeddings)
            if logits is not None:
                router_logits.append(logits)
        logits = self.lm_head(self.norm(x))
        aux = load_balancing_loss(router_logits, self.cfg) if router_logits else None
        return CausalLMOutput(logits=logits, aux_loss=aux)

    def experts_without_tokens(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs that got no token in the last forward on this rank."""
        return [(i, e) for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, SparseMoE)
                for e, n in enumerate(layer.mlp.last_counts) if n == 0]

    def units(self) -> list[nn.Module]:
        return [*self.layers, self]

    def batch(self, batch: int, generator: torch.Generator):
        ids = torch.randint(0, self.cfg.vocab, (batch, self.cfg.seq + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    def loss(self, out: CausalLMOutput, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        if out.aux_loss is not None:
            loss = loss + self.cfg.aux_loss_coef * out.aux_loss.float()
        return loss


def load_balancing_loss(router_logits: list[torch.Tensor], cfg: DecoderConfig) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, as transformers' ``load_balancing_loss_func``:
    experts x (fraction of tokens routed to each expert) . (mean router probability)."""
    logits = torch.cat(router_logits, dim=0).float()
    probs = F.softmax(logits, dim=-1)
    chosen = torch.topk(probs, cfg.top_k, dim=-1).indices
    routed = F.one_hot(chosen, cfg.experts).float().mean(dim=0)  # (top_k, experts)
    return cfg.experts * torch.sum(routed * probs.mean(dim=0).unsqueeze(0))
