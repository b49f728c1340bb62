"""The iteration-aware MILP against the heuristics alone, on the iteration with reductions.

Generated instances (p=2-4 ranks, m=2-6, one stage per rank or the V, at 2p) whose stages
reduce their gradients in 10%, 20% or 40% of the iteration's compute (t_reduce = x * m *
(t_f + t_b + t_w) of the stage, on a 1/16 ms grid) and step their optimizer in a tenth of
that; then the paper's 1.5B and 6.2B profiles at p=8, m=24 with reductions across 64 replicas
at 25 GB/s. Each is solved twice with the same time limit: the default engines (the exact MILP
where the problem is small, MILP windows otherwise) and the heuristics alone (``milp=False``).
Per solve: the iteration, the lower bound, the gap, the status.

Saves bench/results/iteration_milp.json.
Run: PYTHONPATH=. python bench/iteration_milp.py [--count 12] [--seed 0] [--time-limit 5] [--paper-time-limit 10]
"""

from __future__ import annotations

import argparse
import random
import time

from common import save

import zbsearch as zb
from zbsearch.reductions import with_reductions
from zbsearch.solver import solve

PARAMS = {"1.5b-m24": 1.5e9, "6.2b-m24": 6.2e9}
_G = 1 / 16


def _grid(rng: random.Random, lo: float, hi: float) -> float:
    return _G * rng.randint(round(lo / _G), round(hi / _G))


def instance(rng: random.Random) -> tuple[zb.Profile, int, int, float]:
    """(profile with reductions, m, chunks, the reductions' share of the iteration's compute)."""
    p, chunks = rng.choice([2, 3, 4]), rng.choice([1, 2])
    m = rng.randint(max(2, p - 1), 6)
    share = rng.choice([0.1, 0.2, 0.4])
    stages = []
    for _ in range(p):
        t_f, t_b, t_w = _grid(rng, 0.5, 2), _grid(rng, 0.5, 2.5), _grid(rng, 0.25, 2.5)
        m_f = _G * rng.randint(8, 16)
        m_w = _G * rng.randint(1, round(m_f / _G) - 1)
        work = m * (t_f + t_b + t_w)
        stages.append(zb.StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=m_f, m_b=-(m_f - m_w), m_w=-m_w,
                                   t_reduce=max(_G, round(share * work / _G) * _G), t_opt=round(share * work / 10 / _G) * _G))
    comm = [_grid(rng, 0, 0.25) for _ in range(p - 1)]
    prof = zb.Profile(name=f"gen-p{p}", memory_unit="activations", stages=stages, t_comm=comm if p > 1 else 0.0)
    return prof, m, chunks, share


def _row(res) -> dict:
    i = res.info
    return {"value_ms": i.value, "bound_ms": i.lower_bound, "gap": i.gap, "status": i.status, "time_s": i.time_s,
            "construction": i.construction, "milp_windows": i.milp_windows, "milp_improvements": i.milp_improvements}


def compare(prof: zb.Profile, m: int, chunks: int, limit: float) -> dict:
    """The default engines and the heuristics alone, on one problem."""
    with_milp = solve(prof, m, "2p", chunks=chunks, time_limit=limit)
    heuristic = solve(prof, m, "2p", chunks=chunks, time_limit=limit, milp=False)
    assert with_milp.info.objective == "iteration" and heuristic.info.objective == "iteration"
    return {"milp": _row(with_milp), "heuristic": _row(heuristic),
            "bound_ms": max(with_milp.info.lower_bound, heuristic.info.lower_bound)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=12, help="generated instances")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per solve of a generated instance")
    ap.add_argument("--paper-time-limit", type=float, default=10.0, help="seconds per solve of a paper profile")
    ap.add_argument("-o", "--output", default="iteration_milp")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    rows = []
    for k in range(args.count):
        prof, m, chunks, share = instance(rng)
        row = {"name": f"{prof.name}-{k}", "ranks": prof.num_stages, "m": m, "chunks": chunks, "share": share,
               **compare(prof, m, chunks, args.time_limit)}
        rows.append(row)
        print(f"{row['name']} m={m} {'V' if chunks == 2 else 'one'} reduce {share:.0%}: milp {row['milp']['value_ms']:.4f} "
              f"({row['milp']['status']}) heuristic {row['heuristic']['value_ms']:.4f} ({row['heuristic']['status']}) "
              f"bound {row['bound_ms']:.4f}", flush=True)
    for name, params in PARAMS.items():
        base = zb.resolve_profile(name)
        prof = with_reductions(base, 64, 25.0, [2 * params / base.num_stages] * base.num_stages)
        for chunks in (1, 2):
            row = {"name": name, "ranks": base.num_stages, "m": 24, "chunks": chunks, "share": None,
                   **compare(prof, 24, chunks, args.paper_time_limit)}
            rows.append(row)
            print(f"{name} {'V' if chunks == 2 else 'one'}: milp {row['milp']['value_ms']:.2f} ({row['milp']['status']}) "
                  f"heuristic {row['heuristic']['value_ms']:.2f} bound {row['bound_ms']:.2f}", flush=True)
    save({"settings": {"count": args.count, "seed": args.seed, "time_limit": args.time_limit,
                       "paper_time_limit": args.paper_time_limit}, "rows": rows, "wall_s": time.perf_counter() - t0},
         args.output)


if __name__ == "__main__":
    main()
