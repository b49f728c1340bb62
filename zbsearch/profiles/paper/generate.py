"""Writes the bundled paper profiles (arXiv 2401.10241: Table 5's
profiled times, its memory model).

One file per (model, m) because the paper profiled each setting separately. Memory is in units
of M_B: F allocates 1, B frees 1 - M_W/M_B, W frees M_W/M_B = 32h / (34h + 5as), s = 1024.
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

for name, (h, a, p, runs) in MODELS.items():
    mw = 32 * h / (34 * h + 5 * a * SEQ)
    for m, (tf, tb, tw, tc) in runs.items():
        stage = {"t_f": tf, "t_b": tb, "t_w": tw, "m_f": 1.0, "m_b": -(1.0 - mw), "m_w": -mw}
        doc = {
            "format": "zbsearch.profile", "version": 1, "name": f"paper-{name}-m{m}",
            "time_unit": "ms", "memory_unit": "activations", "stages": [stage] * p, "t_comm": tc,
            "memory_capacity": None,
            "source": f"Zero Bubble paper (arXiv 2401.10241) profiled times for the {name} model, p={p}, m={m}; "
                      f"memory from M_B = sb(34h+5as), M_W = 32sbh with h={h}, a={a}, s={SEQ}",
            "num_microbatches": m,
        }
        Path(__file__).with_name(f"{name}-m{m}.json").write_text(json.dumps(doc, indent=1) + "\n")
