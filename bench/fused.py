"""Fused and split backwards: the solver's certificates and schedules where a fused backward
(one BW pass, t_bw) costs less than B + W, against the exact oracle and the classic schedules.

Three parts (``--parts``):

* oracle: generated small instances (families uniform / hetero / heavy, 1 chunk and V, per-link
  comm, limits from the smallest feasible to none) whose stages have t_bw / (t_b + t_w) drawn
  from 0.4 to 1.0 and t_ff up to 10% below t_f (``tests/solver/oracle.with_fused``). The exact
  optimum over split, fused and mixed schedules (CP-SAT, ``fused=True``) and over split ones
  only (what fusing gains); then ``solve``. Per instance: the gap to the mixed optimum, every
  bound above it (unsound, per bound component too), a false 'optimal', and the value against
  the best classic schedule within the limit.
* large: generated profiles (p = 4 and 8, per-stage times drawn at random, per-link comm) with
  t_bw / (t_b + t_w) = 0.4, 0.55, 0.7, 0.85 and 1.0 on every stage, and the bundled profiles
  that record t_bw; m = 4p, limits 1p and 2p, 1 chunk and V. No oracle at this size: the value
  against the best classic kind (which one, by how much), and the bound against every classic
  value within the limit (a bound above a schedule that fits is unsound).
* paper: the paper's profiles (no t_bw: nothing to fuse), solved by this code and, with
  ``--base DIR``, by the code in DIR (e.g. the solver before fused backwards), instance by
  instance in turn so that both see the same load: values, bounds and statuses side by side.

Prints tables and saves bench/results/fused.json; ``python bench/report.py fused`` renders it.
Run: PYTHONPATH=. python bench/fused.py [--count 80] [--time-limit 3] [--large-time-limit 10]
     [--paper-time-limit 10] [--base DIR] [--oracle-cache FILE] [--parts oracle,large,paper]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.common import save
from bench.oracle_cache import cached_optima
from tests.solver.harness import TOL, judge
from tests.solver.oracle import FAMILIES, random_instance, with_fused
from zbsearch import Profile, StageCost, resolve_profile
from zbsearch.formats.profile import BUNDLED_PROFILES
from zbsearch.solver import solve

_SIZES = {1: [(2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (4, 2)], 2: [(2, 2), (2, 3), (3, 2)]}
_LIMITS = ("min", "1p", "1.5p", "2p", "none")
_RATIOS = (0.4, 0.55, 0.7, 0.85, 1.0)
_PAPER = ("1.5b-m24", "1.5b-m32", "1.5b-m64", "6.2b-m24", "6.2b-m32", "6.2b-m64", "14.6b-m48", "28.3b-m96")


# ---- oracle ---------------------------------------------------------------------------------

def _instances(count: int, seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chunks = 1 if i % 3 else 2
        p, m = rng.choice(_SIZES[chunks])
        inst = random_instance(rng, FAMILIES[i % len(FAMILIES)], p, m, chunks, rng.choice(_LIMITS))
        out.append(with_fused(rng, inst))
    return out


def _optima(jobs, args) -> list[tuple[float, bool]]:
    """(value, proven) of the oracle per (instance, objective, options), through ``--oracle-cache``."""
    return [(r.value, r.optimal) for r in cached_optima(jobs, args.oracle_time, args.processes, args.oracle_cache)]


def _ratio(profile: Profile) -> tuple[float, float]:
    r = [st.fused_backward / (st.t_b + st.t_w) for st in profile.stages]
    return min(r), max(r)


def oracle_part(args) -> dict:
    insts = _instances(args.count, args.seed)
    jobs = [(inst, obj) for k, inst in enumerate(insts) for obj in (("span", "makespan") if k % 4 == 0 else ("span",))]
    t0 = time.monotonic()
    mixed = _optima([(i, o, {"fused": True}) for i, o in jobs], args)
    split = _optima([(i, o, {}) for i, o in jobs], args)
    oracle_s = time.monotonic() - t0
    rows = []
    for (inst, obj), (opt, proven), (split_opt, split_proven) in zip(jobs, mixed, split):
        v = judge(inst, obj, opt, args.time_limit)
        res_classic = v.classic
        best_classic = min(res_classic.values()) if res_classic else None
        rows.append({
            "family": inst.family, "p": inst.profile.num_ranks, "chunks": inst.chunks, "m": inst.m,
            "limit": inst.limit_name, "objective": obj, "ratio": _ratio(inst.profile),
            "optimum": opt, "oracle_optimal": proven, "split_optimum": split_opt, "split_oracle_optimal": split_proven,
            "value": v.value, "status": v.status, "lower_bound": v.lower_bound, "gap": v.gap,
            "unsound": v.unsound(), "false_optimal": v.false_optimal, "below_optimum": v.below_optimum,
            "problem": v.problem, "best_classic": best_classic,
            "worse_than_classic": best_classic is not None and v.value > best_classic * (1 + TOL),
            "fused_backwards": v.fused, "split_backwards": v.split, "solve_s": v.time_s,
            "profile": inst.profile.model_dump(mode="json", exclude_none=True),
        })
    groups = defaultdict(list)
    for r in rows:
        groups[f'{r["objective"]} chunks={r["chunks"]}'].append(r)
        groups["all"].append(r)
    summary = {k: _oracle_summary(v) for k, v in sorted(groups.items())}
    print(f"{'oracle group':<22} {'n':>4} {'proven':>6} {'<=1%':>6} {'max':>7} {'unsound':>7} {'falseopt':>8} "
          f"{'>classic':>8} {'mixed<split':>11} {'t mean':>7}")
    for k, s in summary.items():
        print(f"{k:<22} {s['n']:>4} {s['proven']:>6} {s['within_1pct_proven']:>6.1%} {s['max_gap_proven']:>7.2%} "
              f"{s['unsound_bound']:>7} {s['false_optimal']:>8} {s['worse_than_classic']:>8} "
              f"{s['mixed_below_split']:>11} {s['solve_time_mean_s']:>7.2f}")
    return {"oracle_s": oracle_s, "summary": summary, "cases": rows}


def _oracle_summary(rows: list[dict]) -> dict:
    proven = [r for r in rows if r["oracle_optimal"]]
    gaps = [r["gap"] for r in proven] or [0.0]
    comps: dict[str, int] = defaultdict(int)
    for r in rows:
        for k in r["unsound"]:
            comps[k] += 1
    return {
        "n": len(rows), "proven": len(proven),
        "within_1pct_proven": sum(g <= 0.01 + TOL for g in gaps) / len(gaps), "max_gap_proven": max(gaps),
        "unsound_bound": sum(bool(r["unsound"]) for r in rows), "unsound_by_component": dict(comps),
        "false_optimal": sum(r["false_optimal"] for r in rows), "invalid": sum(r["problem"] is not None for r in rows),
        "below_optimum": sum(r["below_optimum"] for r in rows),
        "worse_than_classic": sum(r["worse_than_classic"] for r in rows),
        "mixed_below_split": sum(r["optimum"] < r["split_optimum"] * (1 - TOL) for r in proven),
        "optimal_claims": sum(r["status"] == "optimal" for r in rows),
        "solve_time_mean_s": sum(r["solve_s"] for r in rows) / len(rows),
    }


# ---- large ----------------------------------------------------------------------------------

def _generated(p: int, ratio: float, seed: int) -> Profile:
    rng = random.Random(seed)
    stages = []
    for _ in range(p):
        f, b, w = rng.uniform(0.6, 1.4), rng.uniform(0.8, 1.6), rng.uniform(0.5, 1.3)
        stages.append(StageCost(t_f=f, t_b=b, t_w=w, t_bw=ratio * (b + w), m_f=1.0, m_b=-0.6, m_w=-0.4))
    comm = [rng.uniform(0.0, 0.1) for _ in range(p - 1)]
    return Profile(name=f"gen-p{p}-r{ratio:g}", memory_unit="activations", stages=stages, t_comm=comm)


def _bundled_with_t_bw() -> list[Profile]:
    out = []
    for path in sorted(BUNDLED_PROFILES.rglob("*.json")):
        prof = resolve_profile(str(path))
        if any(st.t_bw is not None for st in prof.stages):
            out.append(prof)
    return out


def large_part(args) -> dict:
    profiles = [_generated(p, r, 1000 * p + k) for p in (4, 8) for k, r in enumerate(_RATIOS)] + _bundled_with_t_bw()
    rows = []
    for prof in profiles:
        for chunks in (1, 2):
            m = 4 * prof.num_ranks
            for limit in ("1p", "2p"):
                res = solve(prof, m, limit, chunks=chunks, time_limit=args.large_time_limit)
                info = res.info
                classic = info.classic
                kind = min(classic, key=lambda k: classic[k]) if classic else None
                best = classic[kind] if kind else None
                rows.append({
                    "profile": prof.name, "p": prof.num_ranks, "ratio": _ratio(prof), "chunks": chunks, "m": m,
                    "limit": limit, "value": info.value, "lower_bound": info.lower_bound, "gap": info.gap,
                    "status": info.status, "kind": res.schedule.kind, "construction": info.construction,
                    "best_classic_kind": kind, "best_classic": best,
                    "vs_classic": None if best is None else info.value / best - 1,
                    "worse_than_classic": best is not None and info.value > best * (1 + TOL),
                    "bound_above_a_classic": any(info.lower_bound > v * (1 + TOL) for v in classic.values()),
                    "fused_backwards": info.fused_backwards, "split_backwards": info.split_backwards,
                    "time_s": info.time_s,
                })
                r = rows[-1]
                print(f"{r['profile']:<16} v={chunks} {limit:<3} value {r['value']:9.4g} bound {r['lower_bound']:9.4g} "
                      f"{r['status']:<10} classic {kind or '-'}:{best or float('nan'):9.4g} "
                      f"({0 if best is None else r['vs_classic']:+.2%}) BW {r['fused_backwards']}/"
                      f"{r['fused_backwards'] + r['split_backwards']}  {r['time_s']:.1f}s", flush=True)
    summary = {
        "n": len(rows), "worse_than_classic": sum(r["worse_than_classic"] for r in rows),
        "bound_above_a_classic": sum(r["bound_above_a_classic"] for r in rows),
        "beats_classic": sum(r["vs_classic"] is not None and r["vs_classic"] < -TOL for r in rows),
        "is_classic": sum(r["vs_classic"] is not None and abs(r["vs_classic"]) <= TOL for r in rows),
        "optimal_claims": sum(r["status"] == "optimal" for r in rows),
    }
    return {"summary": summary, "cases": rows}


# ---- paper ----------------------------------------------------------------------------------

_DRIVER = """
import json, sys
from zbsearch.formats.profile import resolve_profile
from zbsearch.solver import solve
name, m, limit, chunks, t = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
res = solve(resolve_profile(name), m, limit, chunks=chunks, time_limit=t)
i = res.info
print(json.dumps({"value": i.value, "lower_bound": i.lower_bound, "status": i.status, "time_s": i.time_s,
                  "construction": i.construction, "kind": res.schedule.kind,
                  "bw": sum(a.op.value == "BW" for row in res.schedule.rank_actions for a in row)}))
"""


def _paper_run(code: str, name: str, m: int, limit: str, chunks: int, t: float) -> dict:
    env = {**os.environ, "PYTHONPATH": code}
    out = subprocess.run([sys.executable, "-c", _DRIVER, name, str(m), limit, str(chunks), str(t)], env=env,
                         capture_output=True, text=True, check=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def paper_part(args) -> dict:
    here = str(Path(__file__).resolve().parent.parent)
    rows = []
    for name in _PAPER:
        m = int(name.split("-m")[1])
        for chunks, limits in ((1, ("1p", "2p")), (2, ("1p",))):
            if chunks == 2 and not name.startswith("1.5b"):
                continue  # V: the smallest model only (the point is "unchanged", not coverage)
            for limit in limits:
                row = {"profile": name, "m": m, "chunks": chunks, "limit": limit}
                if args.base:
                    row["before"] = _paper_run(args.base, name, m, limit, chunks, args.paper_time_limit)
                row["after"] = _paper_run(here, name, m, limit, chunks, args.paper_time_limit)
                rows.append(row)
                a, b = row["after"], row.get("before")
                print(f"{name:<11} v={chunks} {limit:<3} after {a['value']:10.6g} bound {a['lower_bound']:10.6g} "
                      f"{a['status']:<10}" + (f" before {b['value']:10.6g} bound {b['lower_bound']:10.6g} {b['status']}"
                                               if b else ""), flush=True)
    both = [r for r in rows if "before" in r]
    summary = {
        "n": len(rows),
        "same_value": sum(abs(r["after"]["value"] / r["before"]["value"] - 1) <= TOL for r in both),
        "better": sum(r["after"]["value"] < r["before"]["value"] * (1 - TOL) for r in both),
        "worse": sum(r["after"]["value"] > r["before"]["value"] * (1 + TOL) for r in both),
        "same_bound": sum(abs(r["after"]["lower_bound"] / r["before"]["lower_bound"] - 1) <= TOL for r in both),
        "fused_backwards": sum(r["after"]["bw"] for r in rows),
    }
    return {"summary": summary, "cases": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="oracle,large,paper")
    ap.add_argument("--count", type=int, default=80, help="oracle instances (a quarter also for makespan)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=3.0, help="solve's time limit on oracle instances, s")
    ap.add_argument("--large-time-limit", type=float, default=10.0)
    ap.add_argument("--paper-time-limit", type=float, default=10.0)
    ap.add_argument("--oracle-time", type=float, default=30.0, help="CP-SAT deterministic time limit per solve")
    ap.add_argument("--processes", type=int, default=2, help="oracle processes")
    ap.add_argument("--oracle-cache", help="JSON file of oracle optima, read and extended (e.g. under /tmp)")
    ap.add_argument("--base", help="a checkout of the code to compare with on the paper's profiles")
    ap.add_argument("--results", help="where to save the JSON (default bench/results/fused.json)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    doc: dict = {"benchmark": "fused", "settings": {k: v for k, v in vars(args).items() if k != "results"}}
    t0 = time.monotonic()
    if "oracle" in parts:
        doc["oracle"] = oracle_part(args)
    if "large" in parts:
        doc["large"] = large_part(args)
    if "paper" in parts:
        doc["paper"] = paper_part(args)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    save(doc, "fused", Path(args.results) if args.results else None)


if __name__ == "__main__":
    main()
