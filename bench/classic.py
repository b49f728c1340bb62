"""Classic schedules on the paper's profiled costs vs the paper's Table 5 and Table 8.

Prints a table and saves bench/results/classic.json. Everything here is simulated (the
paper's numbers are simulated from profiled times too), so differences come from schedule
details, not from noise.

Run: python bench/classic.py
"""

from __future__ import annotations

import time

from common import save
from paper import BASE_M, CHUNKS_1F1B_I, KINDS5, TABLE5, TABLE8, rescaled

from zbsearch import build_classic, resolve_profile


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
                     "profile": "bundled" if prof is base else f"rescaled from the p={base.num_stages} profile"})
    for r in rows:
        r["diff"] = round(r["ours"] - r["paper"], 4)
    elapsed = time.perf_counter() - t0

    print(f"{'table':>5} {'model':>6} {'p':>3} {'m':>4} {'schedule':>17} {'ours':>7} {'paper':>7} {'diff':>8} {'peak M_B':>8}")
    for r in rows:
        flag = "  *" if abs(r["diff"]) > 0.005 else ""
        print(f"{r['table']:>5} {r['model']:>6} {r['p']:>3} {r['m']:>4} {r['kind']:>17} {r['ours']:>7.4f} "
              f"{r['paper']:>7.4f} {r['diff']:>+8.4f} {r['peak_memory_MB']:>8.3g}{flag}")
    print("* = differs from the paper by more than 0.005 (see README, 'Classic schedules vs the paper')")
    print(f"{len(rows)} schedules built and simulated in {elapsed:.2f} s")
    save({"benchmark": "classic", "elapsed_s": elapsed, "rows": rows}, "classic")


if __name__ == "__main__":
    main()
