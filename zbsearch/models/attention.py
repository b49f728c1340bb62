"""The attention core of the built-in transformers: what selective recomputation of the
attention re-runs.

The core is what lies between a layer's projections: QK^T scaled, the causal mask where the
model has one, softmax, dropout and the probabilities' weighted sum of V. It is written out as
Megatron's unfused core attention runs it, so that what it saves for the backward, the
attention probabilities (heads x seq x seq per sequence), is there to drop: a fused kernel
(``scaled_dot_product_attention``) saves hardly more than its inputs and output, and leaves
selective recomputation nothing to gain. Declared for selective recomputation in the mode
``"attention"`` (``zbsearch.runtime.selective``); the projections stay outside it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CoreAttention"]


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) [+ causal mask]) V, with ``dropout`` on the probabilities while
    training. Inputs and output are (batch, heads, seq, head_dim)."""

    selective_recompute = "attention"

    def __init__(self, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.causal = causal
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The weighted sum of ``v`` for each query (the same shape as ``q``)."""
        scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if self.causal:  # an added mask saves nothing for the backward
            s, t = q.shape[-2], k.shape[-2]
            scores = scores + torch.full((s, t), float("-inf"), dtype=scores.dtype, device=scores.device).triu(t - s + 1)
        probs = scores.softmax(-1)
        if self.dropout and self.training:
            probs = F.dropout(probs, self.dropout)
        return torch.matmul(probs, v)
