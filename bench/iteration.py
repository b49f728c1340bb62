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

Solve time (--speed, on by default): one iteration-aware solve from scratch (no start), with
reductions across 64 replicas at 25 GB/s (the longest of the sweep), on one stage per rank
and on the V: the 1.5B and 6.2B profiles at p=8, m=24 with 10 s (target: within 1% of the
bound), the 28.3B profile at p=32, m=256 with 60 s (target: a valid schedule, validated
again here, within the limit); wall time as the caller sees it.

With --shard the stages are sharded over the replicas (fully_shard): each reduction is a ring
reduce-scatter, and each stage first gathers its parameters at the step's start (an all-gather
of as many bytes), which the simulator, the bounds and the solver's exact MILP all price.

Saves bench/results/iteration.json (iteration_sharded.json with --shard).
Run: PYTHONPATH=. python bench/iteration.py [--time-limit 10] [--replicas 8 16 64] [--bandwidth 25 50 100]
     [--no-sweep] [--no-speed] [--shard]
"""

from __future__ import annotations

import argparse
import time

from common import save

import zbsearch as zb
from zbsearch.reductions import gain_kept, with_reductions
from zbsearch.solver import solve

PARAMS = {"1.5b-m24": 1.5e9, "6.2b-m24": 6.2e9, "28.3b-m256": 28.3e9}
M = 24
# (profile, m, seconds, target gap or None: a valid schedule within the limit is the target)
SPEED = (("1.5b-m24", 24, 10.0, 0.01), ("6.2b-m24", 24, 10.0, 0.01), ("28.3b-m256", 256, 60.0, None))


def iteration_of(sched: zb.Schedule) -> tuple[float, float]:
    pred = sched.predicted
    assert pred is not None and pred.iteration is not None
    return max(pred.span), max(pred.iteration)


def speed() -> list[dict]:
    """The solve-time targets (module docstring)."""
    from zbsearch.validator import validate

    out = []
    for name, m, limit, target in SPEED:
        base = zb.resolve_profile(name)
        prof = with_reductions(base, 64, 25.0, [2 * PARAMS[name] / base.num_stages] * base.num_stages)
        for chunks in (1, 2):
            t0 = time.perf_counter()
            res = solve(prof, m, "2p", chunks=chunks, time_limit=limit)
            wall = time.perf_counter() - t0
            validate(res.schedule)  # raises if it could not run as written
            row = {"model": name, "ranks": base.num_stages, "m": m, "chunks": chunks, "time_limit_s": limit,
                   "wall_s": wall, "solver_time_s": res.info.time_s, "value_ms": res.info.value,
                   "bound_ms": res.info.lower_bound, "gap": res.info.gap, "status": res.info.status,
                   "construction": res.info.construction, "target_gap": target,
                   "met": wall <= limit * 1.1 + 1 and (target is None or res.info.gap <= target)}
            out.append(row)
            print(f"speed {name} p={base.num_stages} m={m} {'V' if chunks == 2 else 'one'}: {wall:.1f} s (limit {limit:g}), "
                  f"gap {res.info.gap:.2%} {res.info.status}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--bandwidth", type=float, nargs="+", default=[25.0, 50.0, 100.0])
    ap.add_argument("--models", nargs="+", default=["1.5b-m24", "6.2b-m24"])
    ap.add_argument("--no-sweep", action="store_true", help="only the solve-time targets")
    ap.add_argument("--no-speed", action="store_true", help="without the solve-time targets")
    ap.add_argument("--shard", action="store_true", help="stages sharded over the replicas: reduce-scatters and gathers")
    ap.add_argument("-o", "--output", default=None, help="results name (default: iteration, or iteration_sharded)")
    args = ap.parse_args()
    output = args.output or ("iteration_sharded" if args.shard else "iteration")
    t0 = time.perf_counter()
    rows = []
    for name in [] if args.no_sweep else args.models:
        base = zb.resolve_profile(name)
        for n in args.replicas:
            for gbs in args.bandwidth:
                for chunks in (1, 2):
                    stages = base.num_stages * chunks
                    prof = with_reductions(base, n, gbs, [2 * PARAMS[name] / base.num_stages] * base.num_stages,
                                           sharded=args.shard)
                    classic = {k: zb.build_classic(k, prof, M) for k in (("1f1b", "zb-h1") if chunks == 1 else ("zb-v",))}
                    span = solve(prof, M, "2p", chunks=chunks, objective="span", time_limit=args.time_limit)
                    it = solve(prof, M, "2p", chunks=chunks, time_limit=args.time_limit,
                               start=span.schedule.rank_actions)
                    b_span, b_it = iteration_of(classic.get("1f1b") or zb.build_classic("1f1b", prof, M))
                    row = {"model": name, "replicas": n, "bandwidth_gbs": gbs, "chunks": chunks, "stages": stages,
                           "t_reduce_ms": prof.stages[0].t_reduce / chunks,
                           "t_gather_ms": (prof.stages[0].t_gather or 0.0) / chunks, "schedules": {}}
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
    speeds = [] if args.no_speed else speed()
    save({"m": M, "limit": "2p", "time_limit_s": args.time_limit, "sharded": args.shard, "replicas": args.replicas,
          "bandwidth": args.bandwidth, "rows": rows, "speed": speeds,
          "wall_s": time.perf_counter() - t0}, output)


if __name__ == "__main__":
    main()
