"""A per-layer profile of a Llama-like decoder from its shape, for planning before measuring.

Times come from floating-point operations at a given rate per rank (``tflops``, what a rank
sustains, not its peak). Per microbatch of b sequences of s tokens, with hidden size h,
feed-forward size f, h_kv the key/value width and V the vocabulary:

* a decoder layer holds 2h^2 + 2h h_kv (attention) + 3hf (SwiGLU) + 2h (norms) parameters;
  its forward costs 2bs per parameter plus 4bs^2h for attention scores and values; its input
  gradient (B) as much again with the attention part doubled, its weight gradient (W) 2bs per
  parameter (the usual 1 : 1 : 1 split of matrix products, attention having no weights);
* the head (final norm, LM head and loss) costs 2bshV in F, B and W alike, plus the softmax
  and cross-entropy over the logits (a few operations per logit, charged to F and B);
* the embedding is a lookup: its F and W move the looked-up rows (bytes over ``hbm_gb_s``).

Activation memory follows the count of Korthikanti et al. (arXiv 2205.05198) for 16-bit
activations with fused attention (no s^2 term): a layer keeps 34bsh bytes from F, of which its
W needs 32bsh (the inputs of its matrix products) and B frees the rest; the head keeps its
input and the fp32 logits (4bsV), B frees the logits. Parameters are 16-bit (``param_bytes`` 2
per parameter).

Full recomputation (``recompute``, as the bundled paper profiles derive it): a unit's recompute
pass re-runs its forward (t_r = t_f) and its checkpointed forward keeps its input, the 2bsh
bytes of the hidden state entering it (the embedding's input is the batch, held anyway: 0). A
stage of such units keeps its first unit's input (``zbsearch.planner.compose``). Selective
recomputation is not offered: it recomputes the attention cores to drop their s^2 activations,
which fused attention does not store in the first place, so it would keep as much as a plain
forward.

These are estimates: measure the real model (``zbsearch profile --per-layer``) before trusting
a plan to a few percent.
"""

from __future__ import annotations

from ..errors import ZbError
from ..formats.layers import LayerProfile, LinkEstimate, TiedParams, Unit

__all__ = ["llama_layers"]


def llama_layers(
    layers: int, hidden: int, vocab: int, *, heads: int = 32, kv_heads: int | None = None, ffn: int | None = None,
    seq: int = 4096, microbatch_size: int = 1, tflops: float = 400.0, hbm_gb_s: float = 2000.0,
    latency_ms: float = 0.02, bandwidth_gb_s: float = 50.0, tied: bool = False, name: str | None = None,
    recompute: bool = True,
) -> LayerProfile:
    """Units ``embedding, layer.0 .. layer.{layers-1}, head`` of a Llama-like decoder (see the
    module for the model), timed at ``tflops`` (1e12 operations per second per rank), linked by
    ``latency_ms`` plus bytes over ``bandwidth_gb_s``; ``tied``: the head shares the embedding;
    ``recompute``: with full recomputation's costs."""
    for key, value in (("layers", layers), ("hidden", hidden), ("vocab", vocab), ("heads", heads), ("seq", seq),
                       ("microbatch_size", microbatch_size)):
        if value < 1:
            raise ZbError(f"{key} must be at least 1, not {value}")
    if tflops <= 0 or hbm_gb_s <= 0 or bandwidth_gb_s <= 0 or latency_ms < 0:
        raise ZbError("rates must be positive and the latency at least 0")
    if hidden % heads:
        raise ZbError(f"hidden size {hidden} is not a multiple of the {heads} heads")
    h, V, s, b = hidden, vocab, seq, microbatch_size
    kv = (kv_heads or heads) * (h // heads)
    f = ffn or 4 * ((8 * h // 3 + 255) // 256 * 64)
    ms = 1e3 / (tflops * 1e12)  # ms per operation
    bytes_ms = 1e3 / (hbm_gb_s * 1e9)

    layer_params = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    mm = 2 * b * s * layer_params
    attn = 4 * b * s * s * h
    layer = dict(t_f=(mm + attn) * ms, t_b=(mm + 2 * attn) * ms, t_w=mm * ms,
                 m_f=34.0 * b * s * h, m_b=-2.0 * b * s * h, m_w=-32.0 * b * s * h)
    head_mm = 2 * b * s * h * V
    loss = 8 * b * s * V  # softmax, log and gradient of the logits
    head = dict(t_f=(head_mm + loss) * ms, t_b=(head_mm + loss) * ms, t_w=head_mm * ms,
                m_f=4.0 * b * s * V + 2.0 * b * s * h, m_b=-4.0 * b * s * V, m_w=-2.0 * b * s * h)
    rows = 2.0 * b * s * h
    embed = dict(t_f=max(rows * bytes_ms, 1e-6), t_b=1e-6, t_w=max(2 * rows * bytes_ms, 1e-6), m_f=0.0, m_b=0.0, m_w=0.0)
    out_bytes = 2.0 * b * s * h
    if recompute:  # R re-runs the forward; the checkpointed forward keeps the unit's input
        embed.update(t_r=embed["t_f"], m_fc=0.0)
        layer.update(t_r=layer["t_f"], m_fc=out_bytes)
        head.update(t_r=head["t_f"], m_fc=out_bytes)
    units = [Unit(name="embedding", kind="embedding", output_bytes=out_bytes, params=0 if tied else V * h,
                  param_bytes=0.0 if tied else 2.0 * V * h, tied=["embedding"] if tied else [], **embed)]
    units += [Unit(name=f"layer.{i}", kind="layer", output_bytes=out_bytes, params=layer_params,
                   param_bytes=2.0 * layer_params, **layer) for i in range(layers)]
    units.append(Unit(name="head", kind="head", output_bytes=0, params=h + (0 if tied else V * h),
                      param_bytes=2.0 * (h + (0 if tied else V * h)), tied=["embedding"] if tied else [], **head))
    return LayerProfile(
        name=name or f"llama-l{layers}-h{h}-v{V}-s{s}-b{b}",
        units=units,
        tied={"embedding": TiedParams(params=V * h, param_bytes=2.0 * V * h)} if tied else {},
        link=LinkEstimate(latency_ms=latency_ms, bandwidth_gb_s=bandwidth_gb_s, method="assumed",
                          how="given latency and bandwidth"),
        microbatch_size=b,
        dtype="bfloat16",
        model={"model": "analytic llama", "layers": layers, "hidden": h, "vocab": V, "heads": heads, "kv": kv, "ffn": f,
               "seq": s, "microbatch_size": b, "tflops": tflops},
    )
