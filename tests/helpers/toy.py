"""Shared by the runtime and export tests: a tiny model cut into stages, and helpers around it.

The model has what the runtime must get right: an embedding, LayerNorm, attention, biases, a
buffer, a Linear applied twice (one parameter used twice in a stage), and a stage boundary of
three tensors, one of them integer (the token ids, which need no gradient).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import zbsearch as zb

VOCAB, WIDTH = 13, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Linear(WIDTH, WIDTH)  # applied twice
        self.register_buffer("gain", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, h, skip, ids):
        x = self.ln(h)
        a, _ = self.attn(x, x, x, need_weights=False)
        h = h + a
        h = h + self.mlp(torch.tanh(self.mlp(h))) * self.gain
        return h, 0.5 * skip + h, ids


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, 5, WIDTH) * 0.1)
        self.block = Block()

    def forward(self, ids):
        h = self.emb(ids) + self.pos
        return self.block(h, h, ids)


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, h, skip, ids):
        h, skip, _ = self.block(h, skip, ids)
        return self.head(self.ln(h + skip))


def toy_stages(num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    if num_stages == 1:
        return [nn.Sequential(First(), _Star(Last()))]
    return [First()] + [Block() for _ in range(num_stages - 2)] + [Last()]


class _Star(nn.Module):
    """Calls the wrapped module with a tuple input spread as positional arguments."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, args):
        return self.inner(*args)


def toy_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def toy_batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, 5), generator=g), torch.randint(0, VOCAB, (batch, 5), generator=g)


def reference_step(stages: list[nn.Module], ids, targets) -> torch.Tensor:
    """Loss and gradients of the whole model in one process, the runtime's yardstick."""
    x = (ids,)
    for st in stages:
        x = st(*x)
        x = x if isinstance(x, tuple) else (x,)
    loss = toy_loss(x[0], targets)
    loss.backward()
    return loss.detach()


def uniform_profile(p: int) -> zb.Profile:
    return zb.Profile(
        name="unit",
        memory_unit="activations",
        stages=[zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4)] * p,
    )


def copy_stages(stages):
    return [copy.deepcopy(s) for s in stages]
