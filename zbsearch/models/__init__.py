"""Built-in models for profiling, demos and benchmarks (torch): a small GPT and a small
Llama-style decoder, each cut into pipeline stages."""

from .gpt import GPTConfig, gpt_batch, gpt_loss, gpt_stages
from .llama import llama_stages

__all__ = ["GPTConfig", "gpt_stages", "gpt_batch", "gpt_loss", "llama_stages"]
