"""A Llama-style decoder cut into pipeline stages, in plain torch (no ``transformers`` needed).

The split backward's fast path and the benchmarks need the other common layer shape besides
GPT's: RMSNorm (a weight used by an elementwise product), rotary position embeddings (no
parameters, extra elementwise work in B), bias-free projections and a SwiGLU MLP (three
matrices). Cut like ``gpt``: the embedding on stage 0, the final norm and head on the last,
layers shared out evenly; same config (``GPTConfig``), batches and loss as ``gpt``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .attention import CoreAttention
from .gpt import GPTConfig

__all__ = ["llama_stages", "RMSNorm", "LlamaBlock", "SwiGLU", "TokenEmbedding"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale (no mean, no bias)."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension; same shape."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class SwiGLU(nn.Module):
    """A layer's gated MLP, declared for selective recomputation in the mode ``"mlp"``
    (``zbsearch.runtime.selective``): its two wide activations and their product are most of
    what a layer keeps without the attention's, and cheap to compute again."""

    selective_recompute = "mlp"

    def __init__(self, hidden: int) -> None:
        super().__init__()
        inner = 8 * hidden // 3
        self.gate, self.up = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> the same shape."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm layer: rotary causal self-attention (its core declared for selective
    recomputation, ``models.attention``), then a SwiGLU MLP, each with a residual. The heads
    are counted from the projections' outputs, so that a tensor-parallel rank runs its share of
    them (``zbsearch.models.tensor_parallel``)."""

    cos: torch.Tensor  # buffers (register_buffer below)
    sin: torch.Tensor

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.core = CoreAttention(causal=True)
        self.mlp = SwiGLU(hidden)
        d = hidden // heads
        freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(seq).float(), freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> the same shape."""
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (proj(y).view(b, s, -1, h // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        cos, sin = self.cos[:s], self.sin[:s]
        a = self.core(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TokenEmbedding(nn.Embedding):
    """The first stage's token embedding: an ``nn.Embedding`` of a type of its own, which
    ``zbsearch.models.tensor_parallel`` recognises (a stage may hold nothing else)."""


class _Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def llama_stages(cfg: GPTConfig, seed: int = 0) -> list[nn.Module]:
    """The model's ``cfg.stages`` stages; the same seed gives the same weights in every process."""
    cfg.check()
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for s, n in enumerate(cfg.layers_per_stage()):
        parts: list[nn.Module] = [TokenEmbedding(cfg.vocab, cfg.hidden)] if s == 0 else []
        parts += [LlamaBlock(cfg.hidden, cfg.heads, cfg.seq) for _ in range(n)]
        if s == cfg.stages - 1:
            parts.append(_Head(cfg.vocab, cfg.hidden))
        stages.append(nn.Sequential(*parts))
    return stages
