"""A GPT-style decoder cut into pipeline stages, in plain torch.

The profiler, the demo and the benchmarks need a model whose passes have the shape of the
paper's (matrix products in attention and MLP, LayerNorm, a token embedding on the first stage
and an LM head on the last), small enough to run four ranks on a laptop CPU. Stage 0 holds the
embedding, the last stage the final LayerNorm and the head, and the transformer layers are
shared out as evenly as possible (earlier stages take the remainder). Every stage boundary is
one tensor of shape (microbatch, seq, hidden). Each layer declares its attention core
(``models.attention``) and its MLP for selective recomputation, in the modes ``"attention"`` and
``"mlp"`` (``zbsearch.runtime.selective``): the profile chooses which one runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ZbError
from .attention import CoreAttention

__all__ = ["GPTConfig", "gpt_stages", "gpt_batch", "gpt_loss"]


@dataclass(frozen=True)
class GPTConfig:
    """Size of the built-in GPT (and Llama) model and how it is cut: ``stages`` pipeline stages
    of ``layers`` transformer layers in all, microbatches of ``microbatch_size`` sequences.
    ``cut``: the transformer layers of each stage (e.g. a plan's ``layers_per_stage``); the first
    and last stage may hold none (only the embedding, only the head); None shares them evenly."""

    layers: int = 8
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 512
    microbatch_size: int = 4
    stages: int = 4
    cut: tuple[int, ...] | None = None

    def check(self) -> None:
        """Raise a one-line ZbError for a size the model cannot take."""
        for name, value in asdict(self).items():
            if name != "cut" and value < 1:
                raise ZbError(f"gpt: {name} must be at least 1, not {value}")
        if self.hidden % self.heads:
            raise ZbError(f"gpt: hidden size {self.hidden} is not a multiple of the {self.heads} heads")
        if self.cut is not None:
            c = list(self.cut)
            if len(c) != self.stages or sum(c) != self.layers or min(c) < 0 or (len(c) > 2 and min(c[1:-1]) < 1):
                raise ZbError(f"gpt: the cut {c} must be {self.stages} layer counts adding up to {self.layers}, "
                              "each stage but the first and last holding at least one")
            if self.stages == 1 and not c[0]:
                raise ZbError("gpt: a single stage needs at least one layer")
        elif self.layers < self.stages:
            raise ZbError(f"gpt: {self.layers} layers cannot fill {self.stages} stages (at least one layer per stage)")

    def layers_per_stage(self) -> list[int]:
        """Transformer layers on each stage: the cut, else as even as possible, earlier stages
        taking the remainder."""
        if self.cut is not None:
            return list(self.cut)
        q, r = divmod(self.layers, self.stages)
        return [q + (s < r) for s in range(self.stages)]

    def units(self) -> GPTConfig:
        """This model cut into its units: the embedding, each layer, the head (``layers + 2`` stages)."""
        return replace(self, stages=self.layers + 2, cut=(0, *([1] * self.layers), 0))


class Attention(nn.Module):
    """Causal multi-head self-attention: the projections around the core (``core``). The heads
    are counted from ``qkv``'s output, so that a tensor-parallel rank, whose ``qkv`` gives its
    share of each of q, k and v, runs its heads (``zbsearch.models.tensor_parallel``)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.core = CoreAttention(causal=True)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> the same shape."""
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, h // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Sequential):
    """A layer's MLP, declared for selective recomputation in the mode ``"mlp"``
    (``zbsearch.runtime.selective``): it saves its 4x-wide hidden activation twice, and is
    cheap to run again."""

    selective_recompute = "mlp"


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: attention, then a 4x MLP, each with a residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> the same shape."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding (the first stage's input)."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> (batch, seq, hidden)."""
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Head(nn.Module):
    """Final LayerNorm and the LM head (the last stage's output)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> logits (batch, seq, vocab)."""
        return self.out(self.ln(x))


def gpt_stages(cfg: GPTConfig, seed: int = 0) -> list[nn.Module]:
    """The model's ``cfg.stages`` stages; the same seed gives the same weights in every process."""
    cfg.check()
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for s, n in enumerate(cfg.layers_per_stage()):
        parts: list[nn.Module] = [Embedding(cfg.vocab, cfg.hidden, cfg.seq)] if s == 0 else []
        parts += [Block(cfg.hidden, cfg.heads) for _ in range(n)]
        if s == cfg.stages - 1:
            parts.append(Head(cfg.vocab, cfg.hidden))
        stages.append(nn.Sequential(*parts))
    return stages


def gpt_batch(cfg: GPTConfig, microbatches: int = 1, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets for ``microbatches`` microbatches: sequences
    x[t+1] = (5 x[t] + 3) mod vocab from random starts, so that training can be seen to learn."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, cfg.vocab, (microbatches * cfg.microbatch_size, 1), generator=g)]
    for _ in range(cfg.seq):
        tokens.append((5 * tokens[-1] + 3) % cfg.vocab)
    ids = torch.cat(tokens, dim=1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the last stage's logits against ``targets``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
