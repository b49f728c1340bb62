"""Hugging Face causal LMs cut into pipeline stages (GPT-2, and Llama/Mistral/Qwen decoders).

Why: a decoder's layers need more than the hidden state. Each needs the attention mask (causal,
and padding: without it eager attention silently attends to the future or to padding), the
position ids, and in rotary families the cos/sin tables; and GPT-2 ties its LM head to its
token embedding. ``hf_stages`` cuts a ``*ForCausalLM`` into stages that carry what the next
stage needs as tensors the runtime can send: every boundary is ``(hidden, attention_mask,
position_ids)``, and each stage rebuilds the 4-D mask (with the model's own
``create_causal_mask`` / ``create_sliding_window_causal_mask``, by layer type) and the rotary
cos/sin (with the model's own ``rotary_emb``, which has no parameters) from them, exactly as
the unsplit model's forward does. Stage 0 takes ``(input_ids, attention_mask)`` or
``(input_ids, attention_mask, position_ids)``; the last stage returns the logits;
``hf_loss(logits, labels)`` is the model's own causal LM loss (shifted, ``-100`` ignored,
mean over the microbatch's tokens).

The stages share the model's modules (no copies): build the model alike on every rank (same
seed or same checkpoint) and keep your stages. ``HFStages.tied`` declares the embedding/head
tie for ``PipelineRuntime(tied=...)`` when the model ties them, so its gradient is summed.
Dropout draws different random numbers than one process would; train with it, but compare
with dropout off. ``transformers`` is the optional extra ``zbsearch[hf]``; nothing else in
zbsearch imports this module.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ZbError

__all__ = [
    "HFStages",
    "hf_stages",
    "hf_loss",
    "hf_loss_sum",
    "hf_token_count",
    "hf_config",
    "hf_model",
    "hf_batch",
    "build",
    "PRESETS",
]

# model_type -> family: how the embedding, layers, final norm and head are called
_FAMILIES = {"gpt2": "gpt2", "llama": "rotary", "mistral": "rotary", "qwen2": "rotary", "qwen3": "rotary"}

# Tiny random configurations for trying the path without weights (no download).
PRESETS: dict[str, dict] = {
    "gpt2-tiny": dict(
        model_type="gpt2",
        n_layer=8,
        n_embd=32,
        n_head=4,
        n_positions=64,
        vocab_size=96,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "llama-tiny": dict(
        model_type="llama",
        num_hidden_layers=8,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
    ),
    "qwen2-tiny": dict(
        model_type="qwen2",
        num_hidden_layers=8,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
    "mistral-tiny": dict(
        model_type="mistral",
        num_hidden_layers=8,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        sliding_window=8,
    ),
}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ZbError("the Hugging Face path needs transformers: pip install 'zbsearch[hf]'") from None
    return transformers


@dataclass
class HFStages:
    """The stages of one model, the tie declaration for the runtime, and the loss."""

    stages: list[nn.Module]
    tied: list[tuple[str, str]] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)  # decoder layers per stage


class _Stage(nn.Module):
    """Layers ``[lo, hi)`` of the decoder, with the embedding on stage 0 and the norm and head on
    the last stage; holds the model's own modules."""

    # model: a transformers *ForCausalLM, whose submodules are found by name (hence Any)
    def __init__(self, model: Any, family: str, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.family, self.first, self.last = family, first, last
        self.config = model.config
        base = model.transformer if family == "gpt2" else model.model
        self.layers = nn.ModuleList((base.h if family == "gpt2" else base.layers)[lo:hi])
        if family == "gpt2":
            if first:
                self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop
            if last:
                self.norm = base.ln_f
        else:
            self.rotary_emb = base.rotary_emb
            if first:
                self.embed_tokens = base.embed_tokens
            if last:
                self.norm = base.norm
        if last:
            self.lm_head = model.lm_head

    def forward(self, *args):
        if self.first:
            if len(args) not in (2, 3):
                raise ZbError(f"stage 0 takes (input_ids, attention_mask[, position_ids]), got {len(args)} tensors")
            ids, mask = args[0], args[1]
            pos = args[2] if len(args) == 3 else torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            if self.family == "gpt2":
                h = self.drop(self.wte(ids) + self.wpe(pos))
            else:
                h = self.embed_tokens(ids)
        else:
            h, mask, pos = args
        if self.layers:
            h = self._layers(h, mask, pos)
        if not self.last:
            return h, mask, pos
        return self.lm_head(self.norm(h))

    def _layers(self, h, mask, pos):
        masking = _transformers().masking_utils
        kw = _mask_kwargs(masking.create_causal_mask, self.config, h, mask, pos)
        extra = {"cache_position": kw["cache_position"]} if "cache_position" in kw else {}
        if self.family == "gpt2":
            full = masking.create_causal_mask(**kw)
            for block in self.layers:
                h = _hidden(block(h, past_key_values=None, attention_mask=full, use_cache=False, position_ids=pos, **extra))
            return h
        rope = self.rotary_emb(h, position_ids=pos)
        masks: dict[str, torch.Tensor | None] = {}
        for layer in self.layers:
            kind = _attention_type(layer, self.config)
            if kind not in masks:
                make = masking.create_sliding_window_causal_mask if kind == "sliding_attention" else masking.create_causal_mask
                masks[kind] = make(**kw)
            h = _hidden(layer(h, attention_mask=masks[kind], position_ids=pos, past_key_values=None, use_cache=False,
                              position_embeddings=rope, **extra))
        return h


def _hidden(out):
    """A layer's hidden state (some 5.x releases return a tuple whose first item it is)."""
    return out[0] if isinstance(out, tuple) else out


def _mask_kwargs(fn, config, h, mask, pos) -> dict:
    """Arguments of transformers' mask builders, whose names changed within 5.x (``input_embeds``
    became ``inputs_embeds``, ``cache_position`` went away)."""
    names = inspect.signature(fn).parameters
    kw = dict(config=config, attention_mask=mask, past_key_values=None, position_ids=pos)
    kw["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    if "cache_position" in names:
        kw["cache_position"] = torch.arange(h.shape[1], device=h.device)
    return kw


def _attention_type(layer: nn.Module, config) -> str:
    """The mask a layer uses, as its model's forward chooses it (Qwen: per layer; Mistral: by config)."""
    kind = getattr(layer, "attention_type", None)
    if kind is not None:
        return kind
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def hf_stages(model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None) -> HFStages:
    """Cut a ``*ForCausalLM`` into ``num_stages`` stages (2P for V or interleaved placement).

    Layers are shared out evenly (earlier stages take the remainder) unless
    ``layers_per_stage`` says otherwise; a stage may hold no layer (e.g. only the embedding).
    """
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in _FAMILIES:
        raise ZbError(f"hf_stages: model type {kind!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}")
    family = _FAMILIES[kind]
    config: Any = model.config  # a transformers PretrainedConfig
    n = config.num_hidden_layers if family == "rotary" else config.n_layer
    if num_stages < 2:
        raise ZbError(f"hf_stages: a pipeline needs at least 2 stages, not {num_stages}")
    if layers_per_stage is None:
        if n < num_stages:
            raise ZbError(f"hf_stages: {n} layers cannot fill {num_stages} stages; give layers_per_stage")
        q, r = divmod(n, num_stages)
        layers_per_stage = [q + (s < r) for s in range(num_stages)]
    if len(layers_per_stage) != num_stages or sum(layers_per_stage) != n or min(layers_per_stage) < 0:
        raise ZbError(f"hf_stages: layers_per_stage {layers_per_stage} must be {num_stages} counts adding up to the {n} layers")
    stages, lo = [], 0
    for s, k in enumerate(layers_per_stage):
        stages.append(_Stage(model, family, lo, lo + k, s == 0, s == num_stages - 1))
        lo += k
    last = num_stages - 1
    embed = stages[0].wte if family == "gpt2" else stages[0].embed_tokens
    tied = [("0." + ("wte" if family == "gpt2" else "embed_tokens") + ".weight", f"{last}.lm_head.weight")] if (
        stages[last].lm_head.weight is embed.weight) else []
    return HFStages(list(stages), tied, list(layers_per_stage))


def hf_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The causal LM loss of HF's ``*ForCausalLM(labels=...)``: predict token t+1 from t, skip
    labels of -100 (padding), mean over the remaining tokens of the microbatch (``"sum"``: their
    sum, for ``PipelineRuntime(loss_normalization="tokens", count_tokens=hf_token_count)``)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100,
                           reduction=reduction)


def hf_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return hf_loss(logits, labels, "sum")


def hf_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens ``hf_loss`` counts in a microbatch: shifted labels other than -100."""
    return (labels[:, 1:] != -100).sum()


def hf_config(config: str, **overrides):
    """A ``transformers`` config from a preset name (``PRESETS``) or a config JSON file; no download."""
    tf = _transformers()
    if config in PRESETS:
        values = dict(PRESETS[config])
    elif os.path.isfile(config):
        try:
            with open(config) as f:
                values = json.load(f)
        except (OSError, ValueError) as err:
            raise ZbError(f"--hf {config!r}: cannot read the config JSON: {err}") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ZbError(f"--hf {config!r}: a config JSON needs a 'model_type' (one of {', '.join(sorted(_FAMILIES))})")
    else:
        raise ZbError(f"--hf {config!r}: neither a config JSON file nor a preset ({', '.join(PRESETS)})")
    values.update(overrides)
    kind = values.pop("model_type")
    if kind not in _FAMILIES:
        raise ZbError(f"--hf {config!r}: model type {kind!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}")
    return tf.AutoConfig.for_model(kind, **values)


def hf_model(config, seed: int = 0, attn_implementation: str = "eager") -> nn.Module:
    """A randomly initialised ``*ForCausalLM`` (same seed, same weights on every rank)."""
    tf = _transformers()
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def hf_batch(config, batch: int, seq: int, seed: int = 1, padding: str | None = "right"):
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


def build(config: str = "gpt2-tiny", stages: int = 4, microbatch_size: int = 2, seq: int = 32, seed: int = 0,
          attn: str = "eager"):
    """``--model zbsearch.models.hf:build`` (``--hf CONFIG`` calls it too): a random model from
    a preset or config JSON, cut into ``stages``, with one microbatch, the loss and labels."""
    cfg = hf_config(config)
    cut = hf_stages(hf_model(cfg, seed, attn), stages)
    microbatch, labels = hf_batch(cfg, microbatch_size, seq, seed + 1)
    return cut.stages, microbatch, hf_loss, labels
