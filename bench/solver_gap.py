"""zbsearch's solver against the exact oracle on generated small instances.

For each instance (families uniform / hetero / heavy, 1 chunk and V placement, per-link comm,
memory limits from the smallest feasible to none) and each objective (span, makespan):
the true optimum from the CP-SAT oracle (``tests/solver/oracle.py``: every per-rank order,
ASAP timelines as the simulator defines them), then ``zbsearch.solver.solve`` with a short
time limit. Reported per family and placement: the gap value/optimum - 1 (share within 1%,
within 3%, max), bounds above the optimum (unsound; per bound component too), 'optimal'
claims that are false, and the time per instance. For every unsound claim the oracle is run
again restricted to FIFO microbatch orders (what zbsearch's MILP assumes) to tell a wrong
assumption (FIFO optimum > true optimum) from a wrong solve (claim > FIFO optimum).

Prints a table and saves bench/results/solver_gap.json.
Run: PYTHONPATH=. python bench/solver_gap.py [--count 300] [--seed 0] [--time-limit 2] [--processes 2]
     [--oracle-cache FILE]  (optima kept between runs: they do not depend on zbsearch's solver)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections import defaultdict
from pathlib import Path

from bench.oracle_cache import cached_optima
from tests.solver.harness import TOL, judge
from tests.solver.oracle import FAMILIES, OracleResult, random_instance

# (p, m) per placement: small enough for the oracle to prove optimality in seconds
_SIZES = {
    1: [(2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (3, 4), (4, 2), (4, 3), (4, 4)],
    2: [(2, 2), (2, 3), (2, 4), (3, 2), (3, 3)],
}
_LIMITS = ("min", "1p", "1.5p", "2p", "none")


def _instances(count: int, seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chunks = 1 if i % 2 == 0 else 2
        p, m = rng.choice(_SIZES[chunks])
        fam = FAMILIES[i // 2 % len(FAMILIES)]
        out.append(random_instance(rng, fam, p, m, chunks, rng.choice(_LIMITS)))
    return out


def _oracle(jobs, args) -> list[OracleResult]:
    """The oracle's results for (instance, objective, options) jobs, through ``--oracle-cache``
    (cached results have no schedule; this bench reads only the values)."""
    return cached_optima(jobs, args.oracle_time, args.processes, args.oracle_cache)


def _summary(rows: list[dict]) -> dict:
    gaps = [r["gap"] for r in rows]
    comps = defaultdict(int)
    for r in rows:
        for k in r["unsound"]:
            comps[k] += 1
    return {
        "n": len(rows),
        "within_1pct": sum(g <= 0.01 + TOL for g in gaps) / len(gaps),
        "within_3pct": sum(g <= 0.03 + TOL for g in gaps) / len(gaps),
        "max_gap": max(gaps),
        "unsound_bound": sum(bool(r["unsound"]) for r in rows),
        "unsound_by_component": dict(comps),
        "false_optimal": sum(r["false_optimal"] for r in rows),
        "invalid": sum(r["problem"] is not None for r in rows),
        "below_optimum": sum(r["below_optimum"] for r in rows),
        "oracle_unproven": sum(not r["oracle_optimal"] for r in rows),
        "solve_time_mean_s": sum(r["solve_s"] for r in rows) / len(rows),
        "solve_time_max_s": max(r["solve_s"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=300, help="instances (each solved for span and makespan)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=2.0, help="zbsearch solve time limit, s")
    ap.add_argument("--oracle-time", type=float, default=60.0, help="CP-SAT deterministic time limit per solve")
    ap.add_argument("--processes", type=int, default=2, help="oracle processes")
    ap.add_argument("--oracle-cache", help="JSON file of oracle optima, read and extended (e.g. under /tmp)")
    args = ap.parse_args()

    insts = _instances(args.count, args.seed)
    jobs = [(inst, obj) for inst in insts for obj in ("span", "makespan")]
    t0 = time.monotonic()
    opts = _oracle([(i, o, {}) for i, o in jobs], args)
    oracle_s = time.monotonic() - t0
    rows = []
    for (inst, obj), opt in zip(jobs, opts):
        v = judge(inst, obj, opt.value, args.time_limit)
        rows.append({
            "family": inst.family, "p": inst.profile.num_stages, "m": inst.m, "chunks": inst.chunks,
            "limit": inst.limit_name, "objective": obj, "optimum": opt.value, "oracle_optimal": opt.optimal,
            "value": v.value, "status": v.status, "lower_bound": v.lower_bound, "predicted_bound": v.predicted_bound,
            "components": v.components, "gap": v.gap, "unsound": v.unsound(), "false_optimal": v.false_optimal,
            "below_optimum": v.below_optimum, "problem": v.problem, "solve_s": v.time_s,
            "profile": inst.profile.model_dump(mode="json"),
        })
    # classify every unsound claim: FIFO assumption (FIFO optimum > optimum) or solve (claim > FIFO optimum)
    bad = [r for r in rows if r["unsound"] or r["false_optimal"]]
    fifo = _oracle([(i, o, {"fifo": True}) for (i, o), r in zip(jobs, rows) if r["unsound"] or r["false_optimal"]], args)
    for r, f in zip(bad, fifo):
        r["fifo_optimum"] = f.value
        r["cause"] = "fifo-assumption" if f.value > r["optimum"] * (1 + TOL) else "solve"
    groups = defaultdict(list)
    for r in rows:
        groups[f'{r["objective"]} chunks={r["chunks"]} {r["family"]}'].append(r)
        groups[f'{r["objective"]} chunks={r["chunks"]} all'].append(r)
    summary = {k: _summary(v) for k, v in sorted(groups.items())}
    causes = defaultdict(int)
    for r in bad:
        causes[f'{r["objective"]} chunks={r["chunks"]} {r["cause"]}'] += 1

    print(f"{'group':<28} {'n':>4} {'<=1%':>6} {'<=3%':>6} {'max':>7} {'unsound':>7} {'falseopt':>8} {'t mean':>7} {'t max':>6}")
    for k, s in summary.items():
        print(f"{k:<28} {s['n']:>4} {s['within_1pct']:>6.1%} {s['within_3pct']:>6.1%} {s['max_gap']:>7.2%} "
              f"{s['unsound_bound']:>7} {s['false_optimal']:>8} {s['solve_time_mean_s']:>7.2f} {s['solve_time_max_s']:>6.2f}")
        if s["unsound_by_component"]:
            print(f"{'':<28} unsound by component: {s['unsound_by_component']}")
    print("causes of unsound claims:", dict(causes))
    print(f"oracle: {len(jobs) + len(bad)} solves in {oracle_s:.0f} s (+ FIFO re-solves), {args.processes} processes")
    out = Path(__file__).with_name("results") / "solver_gap.json"
    out.write_text(json.dumps({
        "settings": vars(args), "machine": platform.platform(), "load_average": _load(),
        "oracle_s": oracle_s, "summary": summary, "causes": dict(causes), "cases": rows,
    }, indent=1))
    print(f"saved {out}")


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
