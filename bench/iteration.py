"""The iteration on a mesh: what the data-parallel gradient reductions leave of each schedule's
gain, and what the iteration-aware solve wins back.

The paper's 1.5B and 6.2B profiles at p=8, m=24, with reductions across 8, 16 and 64 replicas
at 25, 50 and 100 GB/s per rank: each stage reduces its share of the model's bf16 gradients
(2 bytes per parameter, split evenly over the stages; a ring all-reduce, zbsearch.reductions).
Per point, on one stage per rank and on the V (2 pieces per rank), at 2p:
  1f1b, zb-h1, zb-v      the classic schedules, their iteration with the reductions
  span                   the span-optimal solve, then its reductions
  iteration              the iteration-aware solve (--objective iteration), given the span
                         solve's schedule as a start: never worse by construction; the gain
                         is what the order of the W passes hides
with the iteration's lower bound and the gap to it, and how much of each schedule's span gain
over 1F1B the iteration keeps.
Target: the iteration-aware schedule never slower than the span-optimal one with its
reductions; the remaining gap to the bound at most 2%.

Saves bench/results/iteration.json.
Run: PYTHONPATH=. python bench/iteration.py [--time-limit 10] [--replicas 8 16 64] [--bandwidth 25 50 100]
"""

from __future__ import annotations

import argparse
import time

from common import save

import zbsearch as zb
from zbsearch.reductions import gain_kept, with_reductions
from zbsearch.solver import solve

PARAMS = {"1.5b-m24": 1.5e9, "6.2b-m24": 6.2e9}
M = 24


def iteration_of(sched: zb.Schedule) -> tuple[float, float]:
    pred = sched.predicted
    assert pred is not None and pred.iteration is not None
    return max(pred.span), max(pred.iteration)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--bandwidth", type=float, nargs="+", default=[25.0, 50.0, 100.0])
    ap.add_argument("--models", nargs="+", default=list(PARAMS))
    ap.add_argument("-o", "--output", default="iteration")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for name in args.models:
        base = zb.resolve_profile(name)
        for n in args.replicas:
            for gbs in args.bandwidth:
                for chunks in (1, 2):
                    stages = base.num_stages * chunks
                    prof = with_reductions(base, n, gbs, [2 * PARAMS[name] / base.num_stages] * base.num_stages)
                    classic = {k: zb.build_classic(k, prof, M) for k in (("1f1b", "zb-h1") if chunks == 1 else ("zb-v",))}
                    span = solve(prof, M, "2p", chunks=chunks, objective="span", time_limit=args.time_limit)
                    it = solve(prof, M, "2p", chunks=chunks, time_limit=args.time_limit,
                               start=span.schedule.rank_actions)
                    b_span, b_it = iteration_of(classic.get("1f1b") or zb.build_classic("1f1b", prof, M))
                    row = {"model": name, "replicas": n, "bandwidth_gbs": gbs, "chunks": chunks, "stages": stages,
                           "t_reduce_ms": prof.stages[0].t_reduce / chunks, "schedules": {}}
                    for kind, sched in [*classic.items(), ("span", span.schedule), ("iteration", it.schedule)]:
                        s, i = iteration_of(sched)
                        row["schedules"][kind] = {"span_ms": s, "iteration_ms": i,
                                                  "gain_kept": gain_kept(b_span, b_it, s, i)}
                    row["iteration_bound_ms"] = it.info.lower_bound
                    row["iteration_gap"] = it.info.gap
                    row["iteration_status"] = it.info.status
                    row["gain_ms"] = row["schedules"]["span"]["iteration_ms"] - row["schedules"]["iteration"]["iteration_ms"]
                    rows.append(row)
                    print(f"{name} dp{n} {gbs:g}GB/s {'V' if chunks == 2 else 'one'}: reduce {row['t_reduce_ms']:.1f} ms; "
                          f"span-opt {row['schedules']['span']['iteration_ms']:.2f}  iteration-opt "
                          f"{row['schedules']['iteration']['iteration_ms']:.2f}  gain {row['gain_ms']:.2f} ms  gap "
                          f"{row['iteration_gap']:.2%}", flush=True)
    save({"m": M, "limit": "2p", "time_limit_s": args.time_limit, "rows": rows, "wall_s": time.perf_counter() - t0},
         args.output)


if __name__ == "__main__":
    main()
