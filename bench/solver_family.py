"""``zbsearch solve`` before and after a change, side by side, on a generated family of instances.

Why: a solver change that wins the case it was made for must not be tuned to it. This bench
generates a family the change was not developed on (p 4..8, m 8..24, unit or mildly
heterogeneous pass times, comm 0.05..0.3, memory limits 1p / 1.5p / 2p / none; a ``--seed``
picks it) and runs the solver of the given git revision (``--before``, extracted under a
temporary directory) and of this checkout on each instance in turn, one process each,
alternating, so that both see the same machine load. Per instance: the span each reached, the
lower bound, and the time each took to first reach its final span (from the solve's progress
reports; the construction's own value is reported as soon as it is built).

With ``--no-milp`` both run heuristics only (construction, no search), which depends on the
machine's load only through deadlines: the construction's own before/after.

Prints a table and saves bench/results/solver_family.json (solver_family_no_milp.json with
``--no-milp``, solver_family_REV.json with ``--after REV``).
Run: PYTHONPATH=. python bench/solver_family.py [--before main] [--after REV] [--count 40] [--seed 7]
     [--time-limit 5] [--no-milp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import save

from zbsearch import Profile, StageCost

_ROOT = Path(__file__).resolve().parent.parent
_LIMITS = ("1p", "1.5p", "2p", "none")


def _instance(rng: random.Random) -> dict:
    """One instance: pass times unit, or each within x0.8..x1.25 of 1 on a 1/16 grid."""
    p, m = rng.randint(4, 8), rng.choice([8, 12, 16, 20, 24])
    hetero = rng.random() < 0.5
    m_w = rng.choice([0.4, 0.5])

    def t() -> float:
        return rng.randint(13, 20) / 16 if hetero else 1.0

    stages = [StageCost(t_f=t(), t_b=t(), t_w=t(), m_f=1.0, m_b=-(1.0 - m_w), m_w=-m_w) for _ in range(p)]
    comm = rng.choice([0.05, 0.1, 0.15, 0.2, 0.25, 0.3])
    prof = Profile(name=f"family-p{p}", memory_unit="activations", stages=stages, t_comm=comm)
    return {"profile": prof.model_dump(mode="json"), "m": m, "limit": rng.choice(_LIMITS),
            "hetero": hetero, "comm": comm, "p": p}


def _solve(inst: dict, time_limit: float, milp: bool) -> dict:
    from zbsearch.solver import solve

    t0 = time.monotonic()
    seen: list[tuple[float, float]] = []  # (time, value) of each better value reported

    def progress(phase: str, value: float, bound: float) -> None:
        if value < float("inf") and (not seen or value < seen[-1][1]):
            seen.append((time.monotonic() - t0, value))

    res = solve(Profile.model_validate(inst["profile"]), inst["m"], inst["limit"], time_limit=time_limit,
                progress=progress, milp=milp)
    elapsed = time.monotonic() - t0
    final = res.info.value
    reached = next((t for t, v in seen if v <= final * (1 + 1e-9)), elapsed)
    return {"span": final, "bound": res.info.lower_bound, "status": res.info.status, "time_s": elapsed,
            "time_to_final_s": reached, "construction": res.info.construction}


def _worker(time_limit: float, milp: bool) -> None:
    """Solve each instance read from stdin (one JSON line), answer one JSON line each."""
    for line in sys.stdin:
        print(json.dumps(_solve(json.loads(line), time_limit, milp)), flush=True)


def _start(tree: Path, time_limit: float, milp: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--time-limit", str(time_limit)]
    return subprocess.Popen(cmd + ([] if milp else ["--no-milp"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=tree)


def _short(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def _extract(rev: str, where: Path) -> Path:
    """The tree of git revision ``rev`` under ``where`` (a temporary directory)."""
    where.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=_ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def _ask(proc: subprocess.Popen, inst: dict) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(inst) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("solver worker died")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision to compare against")
    ap.add_argument("--after", help="git revision to compare (default: this checkout as it is); the same as "
                                    "--before measures the noise of time-limited search")
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--no-milp", action="store_true", help="heuristics only (deterministic but for the deadline)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.time_limit, not args.no_milp)
        return
    rng = random.Random(args.seed)
    insts = [_instance(rng) for _ in range(args.count)]
    rev = _short(args.before)
    after = _short(args.after) if args.after else "checkout"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _extract(rev, Path(tmp) / "before"),
                 "after": _extract(after, Path(tmp) / "after") if args.after else _ROOT}
        procs = {name: _start(tree, args.time_limit, not args.no_milp) for name, tree in trees.items()}
        print(f"{'#':>3} {'p':>2} {'m':>3} {'limit':>5} {'comm':>5} {'costs':>6} {'bound':>8} "
              f"{'before':>8} {'t':>5} {'after':>8} {'t':>5}")
        try:
            for i, inst in enumerate(insts):
                got = {name: _ask(proc, inst) for name, proc in procs.items()}
                b, a = got["before"], got["after"]
                rows.append({k: inst[k] for k in ("p", "m", "limit", "comm", "hetero")} | {"before": b, "after": a})
                verdict = ("  better" if a["span"] < b["span"] * (1 - 1e-9)
                           else "  WORSE" if a["span"] > b["span"] * (1 + 1e-9) else "")
                print(f"{i:>3} {inst['p']:>2} {inst['m']:>3} {inst['limit']:>5} {inst['comm']:>5} "
                      f"{'hetero' if inst['hetero'] else 'unit':>6} {a['bound']:8.3f} {b['span']:8.3f} "
                      f"{b['time_to_final_s']:5.2f} {a['span']:8.3f} {a['time_to_final_s']:5.2f}{verdict}", flush=True)
        finally:
            for proc in procs.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()
    better = sum(r["after"]["span"] < r["before"]["span"] * (1 - 1e-9) for r in rows)
    worse = sum(r["after"]["span"] > r["before"]["span"] * (1 + 1e-9) for r in rows)

    def at_bound(side: str) -> int:
        return sum(r[side]["span"] <= r[side]["bound"] * (1 + 1e-6) for r in rows)

    def mean(side: str, key: str) -> float:
        return sum(r[side][key] for r in rows) / len(rows)

    summary = {
        "n": len(rows), "better": better, "worse": worse, "same": len(rows) - better - worse,
        "mean_gap_to_bound_before": sum(r["before"]["span"] / r["after"]["bound"] - 1 for r in rows) / len(rows),
        "mean_gap_to_bound_after": sum(r["after"]["span"] / r["after"]["bound"] - 1 for r in rows) / len(rows),
        "at_bound_before": at_bound("before"), "at_bound_after": at_bound("after"),
        "mean_time_to_final_before_s": mean("before", "time_to_final_s"),
        "mean_time_to_final_after_s": mean("after", "time_to_final_s"),
    }
    print(f"after ({after}) vs before ({rev}): {better} better, {worse} worse, {summary['same']} same of {len(rows)}; "
          f"mean gap to the bound {summary['mean_gap_to_bound_before']:.3%} -> {summary['mean_gap_to_bound_after']:.3%}; "
          f"at the bound {summary['at_bound_before']} -> {summary['at_bound_after']}; mean time to the final span "
          f"{summary['mean_time_to_final_before_s']:.2f} s -> {summary['mean_time_to_final_after_s']:.2f} s")
    # one file per kind of comparison: the checkout's, heuristics only, two given revisions
    name = "solver_family" + ("_no_milp" if args.no_milp else "") + (f"_{after}" if args.after else "")
    settings = {k: v for k, v in vars(args).items() if k != "worker"}
    save({"benchmark": "solver_family", "before": rev, "after": after, "settings": settings, "summary": summary,
          "rows": rows}, name)


if __name__ == "__main__":
    main()
