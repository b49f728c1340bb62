"""A synthetic image classification task for the vision models and their tests.

Each class stamps its own pattern somewhere on noisy images, so that a model trained through a
pipeline can be seen to learn; the same seed gives the same batch in every process.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..errors import ZbError

__all__ = ["image_batch", "image_loss", "shares", "check_positive"]


def image_batch(image: int, channels: int, classes: int, size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` noisy images and their labels: each class has its own pattern (the same in every
    batch), stamped on one cell of a 4 x 4 grid chosen at random per image."""
    patterns = torch.randn(classes, channels, *([max(1, image // 4)] * 2), generator=torch.Generator().manual_seed(0))
    cell = patterns.shape[-1]
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (size,), generator=g)
    images = torch.randn(size, channels, image, image, generator=g) * 0.5
    where = torch.randint(0, 16, (size,), generator=g).tolist()
    for i, k in enumerate(labels.tolist()):
        r, c = divmod(where[i], 4)
        images[i, :, r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] += 2.0 * patterns[k]
    return images, labels


def image_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits against integer labels."""
    return F.cross_entropy(logits, labels)


def shares(blocks: int, stages: int) -> list[int]:
    """``blocks`` split over ``stages`` as evenly as possible, the first stages taking one more."""
    q, r = divmod(blocks, stages)
    return [q + (s < r) for s in range(stages)]


def check_positive(kind: str, values: dict) -> None:
    """Refuse, in one line, any integer field of a model config below 1."""
    for name, value in values.items():
        if isinstance(value, int) and value < 1:
            raise ZbError(f"{kind}: {name} must be at least 1, not {value}")


