"""A small GPT (token + position embedding, causal self-attention, MLP, LayerNorm) cut into
pipeline stages, and a synthetic next-token task it can learn. Used by ``train_gpt.py`` and
the runtime benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Stage(nn.Module):
    """Some blocks; the first stage embeds the tokens, the last applies the head."""

    def __init__(self, cfg: GPTConfig, blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width) if first else None
        self.pos = nn.Parameter(torch.zeros(1, cfg.seq, cfg.width)) if first else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(blocks))
        self.ln = nn.LayerNorm(cfg.width) if last else None
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln(x))
        return x


def gpt_stages(cfg: GPTConfig, num_stages: int, seed: int = 0) -> list[Stage]:
    """The whole model as ``num_stages`` stages (layers spread evenly, earlier stages get any
    extra), built identically on every rank from ``seed``."""
    if cfg.layers < num_stages:
        raise ValueError(f"{cfg.layers} layers cannot fill {num_stages} stages")
    torch.manual_seed(seed)
    per, extra = divmod(cfg.layers, num_stages)
    return [Stage(cfg, per + (s < extra), s == 0, s == num_stages - 1) for s in range(num_stages)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(cfg: GPTConfig, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences x[t+1] = (5 x[t] + 3) mod vocab from random starts: learnable, never seen twice."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    seqs = [start]
    for _ in range(cfg.seq):
        seqs.append((5 * seqs[-1] + 3) % cfg.vocab)
    tokens = torch.cat(seqs, dim=1)
    return tokens[:, :-1], tokens[:, 1:]
