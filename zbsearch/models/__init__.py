"""Built-in models for profiling, demos and benchmarks (torch): a small GPT and a small
Llama-style decoder, a ViT and a ResNet-style conv stack, each cut into pipeline stages.

``zbsearch.models.hf`` cuts Hugging Face causal LMs; it needs the optional ``transformers``
(``pip install 'zbsearch[hf]'``), so it is not imported here: import it by name.
"""

from .gpt import GPTConfig, gpt_batch, gpt_loss, gpt_stages
from .images import image_batch, image_loss
from .llama import llama_stages
from .resnet import ResNetConfig, resnet_stages
from .vit import ViTConfig, vit_stages

__all__ = ["GPTConfig", "gpt_stages", "gpt_batch", "gpt_loss", "llama_stages", "ViTConfig", "vit_stages", "ResNetConfig",
           "resnet_stages", "image_batch", "image_loss"]
