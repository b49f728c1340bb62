"""Writes the bundled paper profiles (arXiv 2401.10241: Table 5's
profiled times, its memory model).

One file per (model, m) because the paper profiled each setting separately. Memory is in units
of M_B: F allocates 1, B frees 1 - M_W/M_B, W frees M_W/M_B = 32h / (34h + 5as), s = 1024.

Recomputation is derived, not measured: the paper's models hold n transformer layers per stage
(the layers plus the embedding and output layers, spread evenly; the first and last stage hold
one fewer). Full recomputation re-runs the stage's forward (t_r = t_f) and a checkpointed
forward keeps the stage's input, 2sbh bytes in fp16, of the n * sb(34h + 5as) the stage's
activations take. Selective recomputation (Korthikanti et al., arXiv 2205.05198, whose
per-layer account is the paper's 34sbh + 5as^2b: the attention block 11sbh + 5as^2b, the MLP
19sbh, the two LayerNorms 4sbh) in the mode the profile names (``selective``):

* ``attention`` (the bundled files; Megatron's selective recomputation): the attention cores,
  whose softmax, dropout mask and dropout output take 5as^2b. The checkpointed forward keeps
  34sbh of each layer's sb(34h + 5as); the recompute pass costs the cores' share of the
  forward's FLOPs, 4s / (24h + 4s).
* ``mlp``: each layer's MLP, whose GeLU input and output (8sbh each) it drops; its input (the
  LayerNorm's output, 2sbh) stays, as the runtime keeps a recomputed module's inputs, and so
  does the dropout mask after it (outside the MLP). The checkpointed forward keeps
  sb(18h + 5as) of each layer's sb(34h + 5as); the recompute pass costs the MLP's share of the
  forward's FLOPs, 16h / (24h + 4s).

Run: python zbsearch/profiles/paper/generate.py (``paper_profile`` gives one profile, in either
mode, as the JSON document).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MODELS", "LAYERS", "SEQ", "paper_profile"]

MODELS = {  # name: (hidden, heads, p, {m: (t_f, t_b, t_w, t_comm)})
    "1.5b": (
        2304,
        24,
        8,
        {24: (18.522, 18.086, 9.337, 0.601), 32: (18.513, 18.086, 9.331, 0.626), 64: (18.546, 18.097, 9.321, 0.762)},
    ),
    "6.2b": (
        4096,
        32,
        8,
        {24: (29.718, 29.444, 19.927, 0.527), 32: (29.802, 29.428, 19.530, 0.577), 64: (29.935, 29.621, 19.388, 0.535)},
    ),
    "14.6b": (
        5120,
        40,
        16,
        {48: (11.347, 11.248, 8.132, 0.377), 64: (11.307, 11.254, 8.101, 0.379), 128: (11.325, 11.308, 8.109, 0.378)},
    ),
    "28.3b": (
        6144,
        48,
        32,
        {96: (10.419, 10.207, 7.715, 0.408), 128: (10.408, 10.204, 7.703, 0.408), 256: (10.402, 10.248, 7.698, 0.460)},
    ),
}
SEQ = 1024
LAYERS = {"1.5b": 22, "6.2b": 30, "14.6b": 46, "28.3b": 62}  # transformer layers (paper Table 3)


def paper_profile(name: str, m: int, selective: str = "attention") -> dict:
    """The profile of the paper's ``name`` model at ``m`` microbatches, its selective
    recomputation in the mode ``selective`` (module docstring), as a JSON document."""
    h, a, p, runs = MODELS[name]
    tf, tb, tw, tc = runs[m]
    s = SEQ
    mw = 32 * h / (34 * h + 5 * a * s)
    n = (LAYERS[name] + 2) // p  # layers per stage: the first and last stage hold one fewer
    per_layer = 34 * h + 5 * a * s  # activation bytes per layer, over sb
    kept_full = 2 * h / (n * per_layer)  # the stage input, fp16
    if selective == "attention":
        kept, share, how = 34 * h / per_layer, 4 * s / (24 * h + 4 * s), "the attention cores: keeps 34sbh per layer, " \
                                                                           "t_rs = t_f * 4s/(24h+4s)"
    elif selective == "mlp":
        kept, share, how = (18 * h + 5 * a * s) / per_layer, 16 * h / (24 * h + 4 * s), \
            "the MLPs: keeps sb(18h+5as) per layer, t_rs = t_f * 16h/(24h+4s)"
    else:
        raise ValueError(f"unknown selective mode {selective!r}")
    stage = {"t_f": tf, "t_b": tb, "t_w": tw, "m_f": 1.0, "m_b": -(1.0 - mw), "m_w": -mw,
             "t_r": tf, "m_fc": kept_full, "t_rs": round(tf * share, 4), "m_fs": kept}
    suffix = "" if selective == "attention" else f"-{selective}"
    return {
        "format": "zbsearch.profile", "version": 1, "name": f"paper-{name}-m{m}{suffix}",
        "time_unit": "ms", "memory_unit": "activations", "stages": [stage] * p, "t_comm": tc,
        "selective": selective,
        "memory_capacity": None,
        "source": f"Zero Bubble paper (arXiv 2401.10241) profiled times for the {name} model, p={p}, m={m}; "
                  f"memory from M_B = sb(34h+5as), M_W = 32sbh with h={h}, a={a}, s={s}; recomputation "
                  f"derived from {n} layers per stage (full: t_r = t_f, keeps the stage input 2sbh; selective, "
                  f"{how})",
        "num_microbatches": m,
    }


if __name__ == "__main__":
    for model, (_, _, _, settings) in MODELS.items():
        for count in settings:
            doc = paper_profile(model, count)
            Path(__file__).with_name(f"{model}-m{count}.json").write_text(json.dumps(doc, indent=1) + "\n")
