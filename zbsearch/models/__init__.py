"""Built-in models for profiling and demos (torch): a small GPT cut into pipeline stages."""

from .gpt import GPTConfig, gpt_batch, gpt_loss, gpt_stages

__all__ = ["GPTConfig", "gpt_stages", "gpt_batch", "gpt_loss"]
