"""Batches and the causal LM loss for a cut Hugging Face model."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["hf_loss", "hf_loss_sum", "hf_token_count", "hf_batch"]


def hf_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The causal LM loss of HF's ``*ForCausalLM(labels=...)``: predict token t+1 from t, skip
    labels of -100 (padding), mean over the remaining tokens of the microbatch (``"sum"``: their
    sum, for ``PipelineRuntime(loss_normalization="tokens", count_tokens=hf_token_count)``)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100,
                           reduction=reduction)


def hf_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``hf_loss`` summed over tokens (the last stage's loss; the runtime divides by the token count)."""
    return hf_loss(logits, labels, "sum")


def hf_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens ``hf_loss`` counts in a microbatch: shifted labels other than -100."""
    return (labels[:, 1:] != -100).sum()


def hf_batch(config: Any, batch: int, seq: int, seed: int = 1, padding: str | None = "right"):
    """Random ``(input_ids, attention_mask), labels`` with padding (``"right"`` or ``"left"``)
    of random length on every other row (labels -100 there), as a tokenizer gives."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padding:
        for row in range(1, batch, 2):
            keep = int(torch.randint(2, max(seq, 3), (), generator=g))
            mask[row, keep:] = 0
            if padding == "left":
                mask[row] = mask[row].flip(0)
    labels = ids.masked_fill(mask == 0, -100)
    return (ids, mask), labels
