"""Hugging Face causal LMs cut into pipeline stages, for most decoder families, exactly.

``hf_stages(model, num_stages)`` cuts a ``*ForCausalLM`` (built from a config or loaded with
``from_pretrained``) into stages that run the model's own forward: each stage rebuilds masks,
rotary tables and position biases with the model's code and runs only its layers; stage 0
adds the embedding side, the last stage the final norm, the head and whatever the model does to
its logits (multipliers, soft-capping). Stage 0 takes ``(input_ids, attention_mask[,
position_ids])``, every boundary carries ``(hidden, attention_mask[, position_ids])``, the last
stage returns the logits; ``hf_loss(logits, labels)`` is the model's causal LM loss. A
parameter that several stages use (a tied embedding and head) is declared in ``.tied`` for
``PipelineRuntime(tied=...)``, which sums its gradient across ranks.

Which families: the cut is derived from the model, not from a list, and checked on a small
batch before it is returned (its logits must equal the whole model's bit for bit); a model it
cannot cut exactly is refused in one line that says why (``anatomy`` and ``stages`` say how).
``bench/hf_families.py`` runs every causal-LM type of the installed transformers.

The stages share the model's modules: build the model alike on every rank (same seed or same
checkpoint) and keep your stages. Dropout draws other random numbers than one process would;
a mixture-of-experts model's auxiliary (load-balancing) loss is not part of the logits, so it
is not trained. ``transformers`` is the optional extra ``zbsearch[hf]``; nothing else in
zbsearch imports this package.
"""

from .anatomy import max_positions
from .configs import (
    DEFAULTS,
    PRESETS,
    build,
    check_length,
    hf_config,
    hf_model,
    parse_counts,
    parse_names,
    profile_shape,
    tiny_config,
)
from .data import hf_batch, hf_loss, hf_loss_sum, hf_token_count
from .stages import HFStage, HFStages, hf_stages

__all__ = [
    "HFStage",
    "HFStages",
    "hf_stages",
    "hf_loss",
    "hf_loss_sum",
    "hf_token_count",
    "hf_batch",
    "hf_config",
    "hf_model",
    "tiny_config",
    "max_positions",
    "check_length",
    "parse_counts",
    "parse_names",
    "profile_shape",
    "build",
    "PRESETS",
    "DEFAULTS",
]
