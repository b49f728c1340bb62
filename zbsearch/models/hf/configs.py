"""Configs and random models for trying the Hugging Face path without weights (no download).

``PRESETS`` are named tiny configs of four common families; ``tiny_config(model_type)``
shrinks the default config of any transformers model type (hidden 32, 2 layers, 4 heads, a
128-token vocabulary, every dropout and router jitter off), keeping what makes the family itself: its layer
types (sliding and full attention mixed as in the original pattern), its experts, its
position scheme. ``hf_config`` takes a preset, ``tiny:TYPE`` or a config JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ...errors import ZbError
from .anatomy import anatomy, max_positions
from .data import hf_batch, hf_loss
from .stages import hf_stages

__all__ = ["PRESETS", "DEFAULTS", "hf_config", "hf_model", "tiny_config", "build", "check_length", "profile_shape",
           "parse_counts", "transformers_module"]

# One set of defaults for every entry point: ``zbsearch profile --hf``, ``--model
# zbsearch.models.hf:build`` and examples/train_hf.py.
DEFAULTS: dict[str, Any] = {"config": "gpt2-tiny", "stages": 4, "microbatch_size": 2, "seq": 32, "seed": 0, "attn": "eager"}

# Tiny random configurations for trying the path without weights (no download).
PRESETS: dict[str, dict] = {
    "gpt2-tiny": dict(
        model_type="gpt2", n_layer=8, n_embd=32, n_head=4, n_positions=64, vocab_size=96, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
    "llama-tiny": dict(
        model_type="llama", num_hidden_layers=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
    ),
    "qwen2-tiny": dict(
        model_type="qwen2", num_hidden_layers=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=True,
    ),
    "mistral-tiny": dict(
        model_type="mistral", num_hidden_layers=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, sliding_window=8,
    ),
}


def transformers_module():
    """The transformers package, or a one-line error naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ZbError("the Hugging Face path needs transformers: pip install 'zbsearch[hf]'") from None
    return transformers


# -- tiny configs of any family ------------------------------------------------------------------
_SIZES: dict[str, int] = {
    key: value
    for value, keys in (
        (32, "hidden_size n_embd d_model embed_dim dim word_embed_proj_dim"),
        (4, "num_attention_heads n_head n_heads num_heads decoder_attention_heads attention_heads"),
        (2, "num_key_value_heads num_kv_heads n_kv_heads kv_n_heads multi_query_group_num"),
        (64, "intermediate_size n_inner ffn_dim ffn_hidden_size decoder_ffn_dim d_ff mlp_dim"),
        (64, "max_position_embeddings n_positions n_ctx max_seq_len max_sequence_length seq_length"),
        (8, "head_dim kv_channels attention_head_dim d_head qk_rope_head_dim qk_nope_head_dim v_head_dim"),
        (8, "state_size d_state mamba_d_state ssm_state_size"),
        (128, "vocab_size n_vocab"),
        # mixtures of experts
        (4, "num_experts num_local_experts n_routed_experts moe_num_experts num_experts_per_layer"),
        (2, "num_experts_per_tok moe_topk top_k moe_k num_selected_experts n_experts_per_tok router_topk"),
        (16, "q_lora_rank kv_lora_rank moe_intermediate_size expert_intermediate_size shared_expert_intermediate_size"),
        (16, "moe_ffn_hidden_size"),
        (1, "n_shared_experts num_shared_experts n_group topk_group first_k_dense_replace"),
    )
    for key in keys.split()
}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


# what a family's default config leaves unset but its model needs
_TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    "hunyuan_v1_dense": {"head_dim": 8},
    "hunyuan_v1_moe": {"head_dim": 8},
    "ministral": {"head_dim": 8},
    "nemotron": {"num_key_value_heads": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}


def _pick(values: list, n: int) -> list:
    """``n`` items of a per-layer list, keeping each distinct value the list has (in order) while
    there is room: a hybrid pattern stays hybrid."""
    out: list = []
    for v in values:
        if v not in out and len(out) < n:
            out.append(v)
    while len(out) < n:
        out.append(values[len(out) % len(values)])
    return out


def _shrink(d: dict, layers: int, old_layers: int | None, vocab: int) -> dict:
    over: dict = {}
    for key, value in d.items():
        if key in _LAYER_KEYS and isinstance(value, int):
            over[key] = layers
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value > _SIZES[key]:
            over[key] = _SIZES[key]
        elif key in _TOKEN_KEYS:
            if isinstance(value, int) and value >= vocab:
                over[key] = vocab - 1
            elif isinstance(value, list):
                over[key] = [min(v, vocab - 1) for v in value if isinstance(v, int)]
        elif isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "jitter")) and value > 0:
            over[key] = 0.0  # no randomness in training mode: a cut can be compared with the model
        elif key in ("sliding_window", "attention_window", "window_size") and isinstance(value, int) and value > 8:
            over[key] = 8
        elif key == "rotary_dim" and isinstance(value, int) and value > 4:
            over[key] = 4
        elif isinstance(value, list) and old_layers and len(value) == old_layers and key not in _TOKEN_KEYS:
            over[key] = _pick(value, layers)
        elif isinstance(value, dict) and key.endswith("_config") and key not in ("quantization_config",):
            sub = _shrink(value, layers, old_layers, vocab)
            if sub:
                over[key] = {**value, **sub}
    return over


def tiny_config(model_type: str, layers: int = 2, **overrides):
    """The default config of ``model_type`` shrunk to a tiny model (see the module docstring);
    ``overrides`` last. A one-line ``ZbError`` if transformers cannot build one."""
    tf = transformers_module()
    try:
        base = tf.AutoConfig.for_model(model_type)
    except Exception as err:
        raise ZbError(f"tiny_config({model_type!r}): {type(err).__name__}: {_first(err)}") from None
    d = base.to_dict()
    old = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    over = _shrink(d, layers, old, 128)
    if d.get("kv_lora_rank") and "num_key_value_heads" in d:  # latent attention: as many key/value heads as heads
        over["num_key_value_heads"] = over.get("num_attention_heads", d.get("num_attention_heads"))
    if "is_decoder" in d and not d.get("is_encoder_decoder"):
        over["is_decoder"] = True  # encoder families as causal LMs (BertLMHeadModel and its like)
    for key, value in _TYPE_OVERRIDES.get(model_type, {}).items():
        over[key] = _pick(value, layers) if key == "layer_types" else value
    over.update(overrides)
    try:
        return tf.AutoConfig.for_model(model_type, **over)
    except Exception as err:
        raise ZbError(f"tiny_config({model_type!r}): {type(err).__name__}: {_first(err)}") from None


def _first(err: BaseException) -> str:
    lines = [x.strip() for x in str(err).strip().splitlines() if x.strip()]
    return " ".join(lines[:2])[:200] if lines else ""


# -- presets, config files, models -----------------------------------------------------------------
def hf_config(config: str, **overrides):
    """A ``transformers`` config from a preset name (``PRESETS``), ``tiny:MODEL_TYPE`` or a
    config JSON file; no download."""
    tf = transformers_module()
    if config.startswith("tiny:"):
        return tiny_config(config.removeprefix("tiny:"), **overrides)
    if config in PRESETS:
        values = dict(PRESETS[config])
    elif os.path.isfile(config):
        try:
            with open(config) as f:
                values = json.load(f)
        except (OSError, ValueError) as err:
            raise ZbError(f"--hf {config!r}: cannot read the config JSON: {err}") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ZbError(f"--hf {config!r}: a config JSON needs a 'model_type'")
    else:
        raise ZbError(f"--hf {config!r}: neither a config JSON file, tiny:MODEL_TYPE nor a preset ({', '.join(PRESETS)})")
    values.update(overrides)
    kind = values.pop("model_type")
    try:
        return tf.AutoConfig.for_model(kind, **values)
    except Exception as err:
        raise ZbError(f"--hf {config!r}: transformers cannot build a {kind!r} config: {_first(err)}") from None


def hf_model(config, seed: int = 0, attn_implementation: str = "eager") -> nn.Module:
    """A randomly initialised ``*ForCausalLM`` (same seed, same weights on every rank)."""
    tf = transformers_module()
    torch.manual_seed(seed)
    try:
        return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    except Exception as err:
        raise ZbError(f"cannot build a {config.model_type!r} causal LM: {type(err).__name__}: {_first(err)}") from None


def profile_shape(config: str, seq: int | None, microbatch_size: int | None) -> tuple[int, int]:
    """``zbsearch profile --hf``'s sequence length and microbatch size: those given, else the
    defaults (``DEFAULTS``; the sequence no longer than the model's positions)."""
    if seq is None:
        limit = max_positions(hf_config(config))
        seq = min(DEFAULTS["seq"], limit[1]) if limit else DEFAULTS["seq"]
    return seq, DEFAULTS["microbatch_size"] if microbatch_size is None else microbatch_size


def check_length(config, seq: int) -> None:
    """Refuse a sequence longer than the model's positions, in one line naming the attribute."""
    limit = max_positions(config)
    if limit is not None and seq > limit[1]:
        raise ZbError(f"sequence length {seq} exceeds the model's {limit[0]} = {limit[1]}; use --seq {limit[1]} or less")


def build(config: str = DEFAULTS["config"], stages: int = DEFAULTS["stages"],
          microbatch_size: int = DEFAULTS["microbatch_size"], seq: int = DEFAULTS["seq"], seed: int = DEFAULTS["seed"],
          attn: str = DEFAULTS["attn"], layers_per_stage: str | list[int] | None = None, units: bool = False,
          selective: str | list[str] | None = None):
    """``--model zbsearch.models.hf:build`` (``--hf CONFIG`` calls it too): a random model from
    a preset, ``tiny:TYPE`` or a config JSON, cut into ``stages``, with one microbatch, the loss
    and labels. ``layers_per_stage``: counts, as a list or a comma-separated string. ``units``:
    cut into its units instead (the embedding side, each layer, the head side: what
    ``zbsearch profile --per-layer`` measures). ``selective``: modes of selective recomputation to
    declare each layer's modules for (``hf_stages``: attention, mlp), as a list or a
    comma-separated string."""
    for name, value in (("stages", stages), ("microbatch_size", microbatch_size), ("seq", seq)):
        if int(value) < 1:
            raise ZbError(f"{name} must be at least 1, not {value}")
    cfg = hf_config(config)
    check_length(cfg, int(seq))
    counts = parse_counts(layers_per_stage)
    model = hf_model(cfg, int(seed), attn)
    if units:
        n = len(anatomy(model).layers)
        stages, counts = n + 2, [0, *([1] * n), 0]
    cut = hf_stages(model, int(stages), counts, parse_names(selective))
    microbatch, labels = hf_batch(cfg, int(microbatch_size), int(seq), int(seed) + 1)
    return cut.stages, microbatch, hf_loss, labels


def parse_names(value: str | list[str] | None) -> list[str]:
    """Names from ``"attention,mlp"`` or a list; None gives none."""
    if value is None:
        return []
    names = value if isinstance(value, list) else str(value).split(",")
    return [n.strip() for n in names if n.strip()]


def parse_counts(value: str | list[int] | None) -> list[int] | None:
    """Layers per stage from ``"3,3,2"`` or a list; None stays None."""
    if value is None or isinstance(value, list):
        return value
    try:
        return [int(x) for x in str(value).split(",")]
    except ValueError:
        raise ZbError(f"layers per stage {value!r}: give comma-separated counts, e.g. 3,3,2") from None
