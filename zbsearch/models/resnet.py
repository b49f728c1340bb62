"""A ResNet-style convolutional network cut into pipeline stages, in plain torch.

Why: a conv stack is the other shape of model a pipeline is given: 4-D activations whose size
shrinks and whose channels grow from stage to stage, and BatchNorm, whose running statistics
are buffers updated in forward. Stage 0 holds the stem (3x3 convolution, BatchNorm, ReLU), the
basic blocks (two 3x3 convolutions with BatchNorm and a residual) are shared out as evenly as
possible, the last stage ends with global average pooling and a linear head. Every boundary is
one feature map (microbatch, channels, height, width). ``build_resnet`` follows the profiler's
``--model`` contract: ``zbsearch profile --model zbsearch.models.resnet:build_resnet``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ZbError
from .images import check_positive, image_batch, image_loss, shares

__all__ = ["ResNetConfig", "resnet_stages", "build_resnet"]


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of the built-in ResNet-style conv stack and how it is cut into stages."""
    image: int = 32
    channels: int = 3
    width: int = 16  # channels of the first group; each later group doubles them and halves the size
    groups: int = 3
    blocks_per_group: int = 2
    classes: int = 10
    microbatch_size: int = 4
    stages: int = 4

    @property
    def blocks(self) -> int:
        """Basic blocks in all groups together."""
        return self.groups * self.blocks_per_group

    def check(self) -> None:
        """Refuse, in one line, a config that cannot be built or cut as asked."""
        check_positive("resnet", asdict(self))
        if self.image % 2 ** (self.groups - 1):
            raise ZbError(f"resnet: image size {self.image} cannot be halved {self.groups - 1} times")
        if self.blocks < self.stages:
            raise ZbError(f"resnet: {self.blocks} blocks cannot fill {self.stages} stages (at least one block per stage)")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual (a strided 1x1 projection when the
    block changes the size or the channels)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two 3x3 conv + BatchNorm layers with a residual (projected where the shape changes)."""
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class PoolHead(nn.Module):
    """Global average pooling and a linear classifier: the last stage's head."""
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.out = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of feature maps."""
        return self.out(x.mean(dim=(2, 3)))


def resnet_stages(cfg: ResNetConfig, seed: int = 0) -> list[nn.Module]:
    """The conv stack's ``cfg.stages`` stages: a stem (3x3 conv, BatchNorm, ReLU) on stage 0,
    ``groups`` groups of basic blocks, global average pooling and a linear head on the last."""
    cfg.check()
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    cin = cfg.width
    for g in range(cfg.groups):
        cout = cfg.width * 2**g
        for b in range(cfg.blocks_per_group):
            blocks.append(BasicBlock(cin, cout, 2 if g > 0 and b == 0 else 1))
            cin = cout
    stem = nn.Sequential(nn.Conv2d(cfg.channels, cfg.width, 3, padding=1, bias=False), nn.BatchNorm2d(cfg.width), nn.ReLU())
    stages: list[nn.Module] = []
    lo = 0
    for s, n in enumerate(shares(cfg.blocks, cfg.stages)):
        parts: list[nn.Module] = [stem] if s == 0 else []
        parts += blocks[lo:lo + n]
        lo += n
        if s == cfg.stages - 1:
            parts.append(PoolHead(cin, cfg.classes))
        stages.append(nn.Sequential(*parts))
    return stages


def build_resnet(stages: int = 4, width: int = 16, groups: int = 3, blocks_per_group: int = 2, image: int = 32,
                 classes: int = 10, microbatch_size: int = 4, seed: int = 0):
    """``--model zbsearch.models.resnet:build_resnet``: the conv stack's stages, one microbatch, the loss and labels."""
    cfg = ResNetConfig(image=image, width=width, groups=groups, blocks_per_group=blocks_per_group, classes=classes,
                       microbatch_size=microbatch_size, stages=stages)
    images, labels = image_batch(image, cfg.channels, classes, microbatch_size, seed + 1)
    return resnet_stages(cfg, seed), images, image_loss, labels
