"""Writes the bundled paper profiles (arXiv 2401.10241: Table 5's
profiled times, its memory model).

One file per (model, m) because the paper profiled each setting separately. Memory is in units
of M_B: F allocates 1, B frees 1 - M_W/M_B, W frees M_W/M_B = 32h / (34h + 5as), s = 1024.

Recomputation is derived, not measured: the paper's models hold n transformer layers per stage
(the layers plus the embedding and output layers, spread evenly; the first and last stage hold
one fewer). Full recomputation re-runs the stage's forward (t_r = t_f) and a checkpointed
forward keeps the stage's input, 2sbh bytes in fp16, of the n * sb(34h + 5as) the stage's
activations take. Selective recomputation (Korthikanti et al., arXiv 2205.05198) recomputes the
attention cores only: the checkpointed forward keeps 34sbh of each layer's sb(34h + 5as), and
the recompute pass costs their share of the forward's FLOPs, 4s / (24h + 4s).
Run: python zbsearch/profiles/paper/generate.py
"""

import json
from pathlib import Path

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

for name, (h, a, p, runs) in MODELS.items():
    mw = 32 * h / (34 * h + 5 * a * SEQ)
    n = (LAYERS[name] + 2) // p  # layers per stage: the first and last stage hold one fewer
    per_layer = 34 * h + 5 * a * SEQ  # activation bytes per layer, over sb
    kept_full = 2 * h / (n * per_layer)  # the stage input, fp16
    kept_selective = 34 * h / per_layer
    attention_share = 4 * SEQ / (24 * h + 4 * SEQ)
    for m, (tf, tb, tw, tc) in runs.items():
        stage = {"t_f": tf, "t_b": tb, "t_w": tw, "m_f": 1.0, "m_b": -(1.0 - mw), "m_w": -mw,
                 "t_r": tf, "m_fc": kept_full, "t_rs": round(tf * attention_share, 4), "m_fs": kept_selective}
        doc = {
            "format": "zbsearch.profile", "version": 1, "name": f"paper-{name}-m{m}",
            "time_unit": "ms", "memory_unit": "activations", "stages": [stage] * p, "t_comm": tc,
            "memory_capacity": None,
            "source": f"Zero Bubble paper (arXiv 2401.10241) profiled times for the {name} model, p={p}, m={m}; "
                      f"memory from M_B = sb(34h+5as), M_W = 32sbh with h={h}, a={a}, s={SEQ}; recomputation "
                      f"derived from {n} layers per stage (full: t_r = t_f, keeps the stage input 2sbh; selective: "
                      f"keeps 34sbh per layer, t_rs = t_f * 4s/(24h+4s))",
            "num_microbatches": m,
        }
        Path(__file__).with_name(f"{name}-m{m}.json").write_text(json.dumps(doc, indent=1) + "\n")
