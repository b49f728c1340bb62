"""Classic schedules on the paper's profiled costs vs the paper's Table 5 and Table 8.

Prints a table and saves bench/results/classic.json. Everything here is simulated (the
paper's numbers are simulated from profiled times too), so differences come from schedule
details, not from noise.

Run: python bench/classic.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from zbsearch import Profile, build_classic, resolve_profile
from zbsearch.formats.edit import updated

# REFERENCE.md section 5, Table 5 (bubble rate): model -> m -> kind -> paper value
TABLE5 = {
    "1.5b": {24: (.243, .106, .159, .108), 32: (.199, .082, .124, .084), 64: (.124, .044, .067, .044)},
    "6.2b": {24: (.235, .081, .132, .070), 32: (.190, .063, .105, .056), 64: (.109, .032, .055, .029)},
    "14.6b": {48: (.255, .110, .140, .067), 64: (.208, .085, .109, .052), 128: (.125, .045, .058, .027)},
    "28.3b": {96: (.265, .149, .142, .064), 128: (.217, .116, .111, .049), 256: (.135, .062, .059, .026)},
}
KINDS5 = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
# The paper does not state its 1F1B-I chunk count. One transformer layer per chunk
# (layers / p, REFERENCE Table 3: 22/8, 30/8, 46/16, 62/32) reproduces its numbers;
# v = 2 everywhere does not (it is +0.015..+0.05 above the paper for the p = 8 and 16 models).
CHUNKS_1F1B_I = {"1.5b": 3, "6.2b": 4, "14.6b": 3, "28.3b": 2}
# Table 8 (ZB-V): (model, p, m) -> paper bubble; the profile behind p comes from the model's Table 5 profile.
TABLE8 = {
    ("6.2b", 16, 48): .0697, ("6.2b", 16, 64): .0533, ("6.2b", 16, 128): .0274,
    ("14.6b", 24, 72): .0638, ("14.6b", 24, 96): .0483, ("14.6b", 24, 192): .0250,
    ("28.3b", 32, 96): .0593, ("28.3b", 32, 128): .0451, ("28.3b", 32, 256): .0236,
}
BASE_M = {"6.2b": 24, "14.6b": 48, "28.3b": 96}


def rescaled(prof: Profile, p: int) -> Profile:
    """The same model on p stages: per-stage times scale with layers per stage, comm stays."""
    k = prof.num_stages / p
    st = prof.stages[0]
    stage = updated(st, t_f=st.t_f * k, t_b=st.t_b * k, t_w=st.t_w * k)
    return updated(prof, stages=[stage] * p, name=f"{prof.name}-rescaled-p{p}")


def main() -> None:
    rows = []
    t0 = time.perf_counter()
    for model, runs in TABLE5.items():
        for m, paper in runs.items():
            prof = resolve_profile(f"{model}-m{m}")
            for kind, ref in zip(KINDS5, paper):
                v = CHUNKS_1F1B_I[model] if kind == "interleaved-1f1b" else None
                sched = build_classic(kind, prof, m, chunks=v)
                rows.append({"table": 5, "model": model, "p": prof.num_stages, "m": m,
                             "kind": kind + (f" v={v}" if v else ""),
                             "ours": round(sched.predicted.bubble_rate, 4), "paper": ref,
                             "peak_memory_MB": round(max(sched.predicted.peak_memory), 3)})

    for (model, p, m), ref in TABLE8.items():
        base = resolve_profile(f"{model}-m{BASE_M[model]}")
        prof = base if base.num_stages == p else rescaled(base, p)
        sched = build_classic("zb-v", prof, m)
        rows.append({"table": 8, "model": model, "p": p, "m": m, "kind": "zb-v",
                     "ours": round(sched.predicted.bubble_rate, 4), "paper": ref,
                     "peak_memory_MB": round(max(sched.predicted.peak_memory), 3),
                     "profile": "bundled" if prof is base else "rescaled from the p=%d profile" % base.num_stages})
    for r in rows:
        r["diff"] = round(r["ours"] - r["paper"], 4)
    elapsed = time.perf_counter() - t0

    print(f"{'table':>5} {'model':>6} {'p':>3} {'m':>4} {'schedule':>17} {'ours':>7} {'paper':>7} {'diff':>8} {'peak M_B':>8}")
    for r in rows:
        flag = "  *" if abs(r["diff"]) > 0.005 else ""
        print(f"{r['table']:>5} {r['model']:>6} {r['p']:>3} {r['m']:>4} {r['kind']:>17} {r['ours']:>7.4f} "
              f"{r['paper']:>7.4f} {r['diff']:>+8.4f} {r['peak_memory_MB']:>8.3g}{flag}")
    print(f"* = differs from the paper by more than 0.005 (see README, 'Classic schedules vs the paper')")
    print(f"{len(rows)} schedules built and simulated in {elapsed:.2f} s")
    out = Path(__file__).with_name("results") / "classic.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"benchmark": "classic", "elapsed_s": elapsed, "rows": rows}, indent=1) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
