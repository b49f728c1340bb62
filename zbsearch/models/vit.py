"""A Vision Transformer cut into pipeline stages, in plain torch.

Why: the split backward and the schedules are not specific to language models. A ViT is the
encoder shape of model: a patch embedding (a strided convolution, a class token, learned
positions) on stage 0, bidirectional attention blocks shared out as evenly as possible
(earlier stages take the remainder), a LayerNorm and a linear classifier on the class token on
the last stage. Every boundary is one tensor (microbatch, tokens, hidden). ``build_vit``
follows the profiler's ``--model`` contract:
``zbsearch profile --model zbsearch.models.vit:build_vit --model-arg layers=8``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import ZbError
from .attention import CoreAttention
from .images import check_positive, image_batch, image_loss, shares

__all__ = ["ViTConfig", "vit_stages", "build_vit"]


@dataclass(frozen=True)
class ViTConfig:
    """Shape of the built-in Vision Transformer and how it is cut into stages."""
    image: int = 32
    patch: int = 8
    channels: int = 3
    hidden: int = 64
    heads: int = 4
    layers: int = 8
    classes: int = 10
    microbatch_size: int = 4
    stages: int = 4

    def check(self) -> None:
        """Refuse, in one line, a config that cannot be built or cut as asked."""
        check_positive("vit", asdict(self))
        if self.image % self.patch:
            raise ZbError(f"vit: image size {self.image} is not a multiple of the patch size {self.patch}")
        if self.hidden % self.heads:
            raise ZbError(f"vit: hidden size {self.hidden} is not a multiple of the {self.heads} heads")
        if self.layers < self.stages:
            raise ZbError(f"vit: {self.layers} blocks cannot fill {self.stages} stages (at least one block per stage)")


class PatchEmbedding(nn.Module):
    """Non-overlapping patches projected by a strided convolution, a class token in front,
    learned positions added."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (cfg.image // cfg.patch) ** 2 + 1, cfg.hidden) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Patch tokens of a batch of images, a class token first, positions added."""
        x = self.proj(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos


class MLP(nn.Sequential):
    """A block's MLP, declared for selective recomputation in the mode ``"mlp"``
    (``zbsearch.runtime.selective``): its 4x-wide hidden activation, saved twice, is most of
    what a block keeps without the attention's."""

    selective_recompute = "mlp"


class EncoderBlock(nn.Module):
    """Pre-LayerNorm encoder layer: bidirectional self-attention (its core declared for selective
    recomputation, ``models.attention``), then a GELU MLP, each with a residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.core = CoreAttention(causal=False)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = MLP(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention then MLP, each on the normalised input and added back."""
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.ln2(x))


class ClassHead(nn.Module):
    """Final LayerNorm and a linear classifier on the class token."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits from the class token."""
        return self.out(self.ln(x[:, 0]))


def vit_stages(cfg: ViTConfig, seed: int = 0) -> list[nn.Module]:
    """The ViT's ``cfg.stages`` stages; the same seed gives the same weights in every process."""
    cfg.check()
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for s, n in enumerate(shares(cfg.layers, cfg.stages)):
        parts: list[nn.Module] = [PatchEmbedding(cfg)] if s == 0 else []
        parts += [EncoderBlock(cfg.hidden, cfg.heads) for _ in range(n)]
        if s == cfg.stages - 1:
            parts.append(ClassHead(cfg.hidden, cfg.classes))
        stages.append(nn.Sequential(*parts))
    return stages


def build_vit(stages: int = 4, layers: int = 8, hidden: int = 64, heads: int = 4, image: int = 32, patch: int = 8,
              classes: int = 10, microbatch_size: int = 4, seed: int = 0):
    """``--model zbsearch.models.vit:build_vit``: the ViT's stages, one microbatch, the loss and labels."""
    cfg = ViTConfig(image=image, patch=patch, hidden=hidden, heads=heads, layers=layers, classes=classes,
                    microbatch_size=microbatch_size, stages=stages)
    images, labels = image_batch(image, cfg.channels, classes, microbatch_size, seed + 1)
    return vit_stages(cfg, seed), images, image_loss, labels


