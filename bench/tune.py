"""The tuner: exactness against every configuration, speed-up over the baselines, time.

Sections (``--only`` runs some; each is saved into bench/results/tune.json as it finishes):

* ``exact``: grids small enough to plan every configuration (16 ranks, microbatch sizes 1, 2
  and 4, 12 to 24 layers): every configuration planned the way tune plans (``--plan-time``
  seconds each, in this process, then the few that may win planned again with
  ``REPLAN_FACTOR`` times as long by tune's own rule, ``replan_order``, each keeping its
  best), against ``tune`` with the same time per plan: tune's choice within 1% of the best
  configuration, its bound never above it. Both sides plan on the work clock (``--wall``: on
  the wall clock), so one configuration planned with one limit gives one plan on either side
  and at any load; where the results file holds a wall-clock run of the section, each grid's
  best is set against it (the work limit's plans as good as the time-limited ones). The
  section also reports the enumeration's own value of tune's choice (the choice alone), the
  choice against the best of every plan made of each configuration by either side (pooled),
  and how far the two plans of one configuration differ (the plans' spread: on the work
  clock, the first plan against the longer second one).
* ``baselines``: generated Llama-like models (7B to 70B shapes, vocabularies 32k to 256k) on
  16 to 256 ranks, 8 to a node, 80 GiB per rank, mixed precision: tune's choice against the best
  of torchtitan's and Megatron-LM's defaults, costed the same way; the speed-up distribution.
* ``time``: 80 layers (70B), 64 ranks, 3 microbatch sizes, the ``zbsearch tune`` command
  timed from the outside at several time limits: what it chose by then.

The real runs of tune's choice on local processes are ``bench/tune_run.py``'s.

The generated profiles (``zbsearch.planner.llama_layers``) run a rank at a rate that grows with
the tokens of a microbatch, ``tflops x tokens / (tokens + 512)``, as accelerators fill better
with larger products; the links are 150 GB/s per rank in a node and 25 GB/s between nodes,
the optimizer state streams at 2000 GB/s.

Run: PYTHONPATH=. python bench/tune.py [--only exact,baselines,time] [--plan-time 1] [--case-time 120]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, save_section

from zbsearch.formats.layers import save_layers
from zbsearch.planner import llama_layers
from zbsearch.tuner import Cluster, OptimizerSetup, SizedLayers, tune
from zbsearch.tuner.bounds import cannot_fit
from zbsearch.tuner.costing import on_cluster
from zbsearch.tuner.evaluate import Task, evaluate
from zbsearch.tuner.search import REPLAN_FACTOR, replan_order
from zbsearch.tuner.space import configurations

OUT = RESULTS / "tune.json"
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
SIZES = (1, 2, 4)
GIB = 2**30

# name: layers, hidden, heads, kv heads, ffn, vocab
MODELS = {
    "7b-32k": (32, 4096, 32, 32, 11008, 32000),
    "8b-128k": (32, 4096, 32, 8, 14336, 128256),
    "9b-256k": (42, 3584, 16, 8, 14336, 256000),
    "13b-32k": (40, 5120, 40, 40, 13824, 32000),
    "34b-64k": (48, 8192, 64, 8, 22016, 64000),
    "70b-128k": (80, 8192, 64, 8, 28672, 128256),
}


def profiles(name: str, seq: int = 4096, tflops: float = 400.0, sizes=SIZES, layers: int | None = None):
    L, h, heads, kv, ffn, vocab = MODELS[name]
    return [llama_layers(layers or L, h, vocab, heads=heads, kv_heads=kv, ffn=ffn, seq=seq, microbatch_size=b,
                         tflops=tflops * b * seq / (b * seq + 512), name=f"{name}-b{b}") for b in sizes]


def cluster(ranks: int, memory: float = 80 * GIB) -> Cluster:
    return Cluster(ranks=ranks, ranks_per_node=min(8, ranks), memory_bytes=memory, intra_node_gbs=150.0,
                   inter_node_gbs=25.0, memory_gbs=2000.0)


def _store(key: str, value) -> None:
    save_section(OUT, key, value)


def exact(args) -> dict:
    """Every configuration of small grids planned, against tune."""
    grids = [  # model, layers, ranks, memory GiB, global batch, optimizer, sharded
        ("7b-32k", 12, 16, 24, 64, "mixed", False),
        ("8b-128k", 16, 16, 24, 128, "mixed", True),
        ("9b-256k", 20, 16, 32, 64, "mixed", False),
        ("13b-32k", 24, 16, 40, 128, "mixed", True),
        ("7b-32k", 16, 16, 80, 256, "mixed", True),  # memory to spare: few stages
        ("13b-32k", 24, 16, 14, 64, "mixed", False),  # tight: many stages, recomputation
    ]
    rows = []
    work = not args.wall
    earlier = json.loads(OUT.read_text()).get("exact") if OUT.is_file() else None
    wall_rows = {} if not earlier or earlier.get("clock", "wall") != "wall" else {
        (r["model"], r["layers"], r["ranks"], r["memory_gib"], r["global_batch"]): r for r in earlier["rows"]}
    picked = [grids[int(i)] for i in args.grids.split(",")] if args.grids else grids
    for name, layers, ranks, mem, batch, optimizer, sharded in picked:
        profs = profiles(name, seq=2048, layers=layers)
        cl, opt = cluster(ranks, mem * GIB), OptimizerSetup(optimizer, sharded)
        sized = SizedLayers(profs)
        configs, _ = configurations(sized.reference.num_units, ranks, 1, batch, list(SIZES), ("one", "v"), ("auto",))
        plans, bounds, found, t0 = {}, {}, {}, time.monotonic()
        for c in configs:
            lay = on_cluster(sized.at(c.b), c.mesh, cl)
            if cannot_fit(lay, c.stages, c.mesh.pp, cl.memory_bytes, opt, c.mesh.dp) is not None:
                continue
            ev = evaluate(Task(c, lay, cl, opt, args.plan_time, 0.0, deterministic=work))
            if ev.costed is not None:
                plans[str(c)], bounds[str(c)], found[str(c)] = [ev.costed.iteration], ev.bound, (c, lay)
        names = list(plans)  # the second look, as tune takes it
        for i in replan_order([(plans[n][0], bounds[n]) for n in names]):
            c, lay = found[names[i]]
            ev = evaluate(Task(c, lay, cl, opt, REPLAN_FACTOR * args.plan_time, bounds[names[i]] or 0.0,
                               deterministic=work))
            if ev.costed is not None:
                plans[names[i]].append(ev.costed.iteration)
        every = {n: min(v) for n, v in plans.items()}
        spread = max((max(v) / min(v) - 1 for v in plans.values() if len(v) > 1), default=0.0)
        enum_s = time.monotonic() - t0
        t0 = time.monotonic()
        res = tune(profs, cl, batch, optimizer=optimizer, sharded=sharded, time_limit=3600, plan_time=args.plan_time,
                   baselines=False, deterministic=work).result
        tune_s = time.monotonic() - t0
        best_name = min(every, key=every.__getitem__)
        w = res.winner
        chosen = _name(w)
        pooled = dict(every)  # each configuration's best plan by either side
        for r in res.rows:
            if r.plans_ms:
                pooled[_name(r)] = min(pooled.get(_name(r), float("inf")), *r.plans_ms)
        pooled_best = min(pooled.values())
        row = {"model": name, "layers": layers, "ranks": ranks, "memory_gib": mem, "global_batch": batch,
               "optimizer": f"{optimizer}{' sharded' if sharded else ''}", "configurations": len(configs),
               "costed_by_enumeration": len(every), "best": every[best_name], "best_config": best_name,
               "tune": w.iteration_ms, "tune_config": f"pp{w.pp} dp{w.dp} b{w.microbatch_size} m{w.microbatches} "
               f"{w.placement}", "ratio": w.iteration_ms / every[best_name], "tune_plans": w.plans_ms,
               "choice_enumerated": every.get(chosen),
               "choice_ratio": every[chosen] / every[best_name] if chosen in every else None,
               "enumeration_plans": plans, "enumeration_replanned": sum(len(v) > 1 for v in plans.values()),
               "pooled_choice": pooled[chosen], "pooled_best": pooled_best,
               "pooled_best_config": min(pooled, key=pooled.__getitem__), "pooled_ratio": pooled[chosen] / pooled_best,
               "plans_spread": spread, "tune_replanned": sum(len(r.plans_ms or []) > 1 for r in res.rows),
               "tune_rows": [{"config": _name(r), "status": r.status, "plans_ms": r.plans_ms, "bound": r.bound_ms}
                             for r in res.rows],
               "bound": res.lower_bound_ms,
               "bound_ok": res.lower_bound_ms <= every[best_name] * (1 + 1e-9), "gap": res.gap,
               "bound_before": res.bound_before_planning_ms, "gap_before": res.gap_before_planning,
               "bound_before_ok": (res.bound_before_planning_ms is not None
                                   and res.bound_before_planning_ms <= every[best_name] * (1 + 1e-9)),
               "planned_by_tune": sum(r.status == "costed" for r in res.rows),
               "statuses": {s: sum(r.status == s for r in res.rows) for s in {r.status for r in res.rows}},
               "enumeration_s": enum_s, "tune_s": tune_s}
        wall = wall_rows.get((name, layers, ranks, mem, batch))
        if work and wall is not None:  # the same grid planned on the wall clock: this limit's plans as good?
            firsts = [v[0] / wall["enumeration_plans"][n][0] for n, v in plans.items() if n in wall["enumeration_plans"]]
            row.update(wall_best=wall["best"], vs_wall_best=every[best_name] / wall["best"],
                       vs_wall_first_median=statistics.median(firsts) if firsts else None,
                       vs_wall_plan_time_s=earlier["plan_time_s"])
        rows.append(row)
        print(f"exact {name} L{layers} r{ranks}: best {row['best']:.6g} ({best_name}); tune {row['tune']:.6g} "
              f"({row['tune_config']}) ratio {row['ratio']:.4f}, choice {row['choice_ratio']}, pooled "
              f"{row['pooled_ratio']:.4f}, spread {spread:.4f}; "
              f"bound {row['bound']:.6g} ok {row['bound_ok']}; "
              f"planned {row['planned_by_tune']}/{len(configs)}; {enum_s:.0f} s / {tune_s:.0f} s", flush=True)
    return {"plan_time_s": args.plan_time, "replan_factor": REPLAN_FACTOR, "sizes": list(SIZES), "seq": 2048,
            "clock": "work" if work else "wall", "rows": rows}


def _name(r) -> str:
    """A tune row's configuration as ``Config`` names it (the enumeration's keys)."""
    return f"pp{r.pp} x dp{r.dp} x tp{r.tp}, b={r.microbatch_size}, m={r.microbatches} ({r.placement}, recompute auto)"


def baselines(args) -> dict:
    """tune against the baselines on generated models and clusters."""
    cases = [  # model, ranks, global batch (sequences of 4096), sharded
        ("7b-32k", 16, 512, False), ("8b-128k", 16, 512, True), ("9b-256k", 32, 512, False),
        ("13b-32k", 32, 512, True), ("8b-128k", 64, 1024, False), ("34b-64k", 64, 1024, True),
        ("70b-128k", 64, 1024, True), ("9b-256k", 128, 1024, True), ("13b-32k", 128, 1024, False),
        ("70b-128k", 128, 1024, True), ("34b-64k", 256, 2048, True), ("70b-128k", 256, 2048, True),
    ]
    if args.cases:
        cases = cases[:args.cases]
    rows = []
    for name, ranks, batch, sharded in cases:
        t0 = time.monotonic()
        res = tune(profiles(name), cluster(ranks), batch, optimizer="mixed", sharded=sharded,
                   time_limit=args.case_time).result
        took = time.monotonic() - t0
        w, base = res.winner, res.best_baseline()
        families = {}
        for r in res.rows:
            if r.source != "tune" and r.iteration_ms is not None and (
                    r.source not in families or r.iteration_ms < families[r.source]["iteration_ms"]):
                families[r.source] = {"iteration_ms": r.iteration_ms, "pp": r.pp, "dp": r.dp, "b": r.microbatch_size,
                                      "m": r.microbatches, "recompute": r.recompute}
        row = {"model": name, "ranks": ranks, "global_batch": batch, "sharded": sharded, "time_limit_s": args.case_time,
               "time_s": took, "tune": None if w is None else w.iteration_ms, "source": None if w is None else w.source,
               "config": None if w is None else {"pp": w.pp, "dp": w.dp, "b": w.microbatch_size, "m": w.microbatches,
                                                 "placement": w.placement, "recompute": w.recompute},
               "tokens_per_s": None if w is None else w.tokens_per_s, "bound": res.lower_bound_ms, "gap": res.gap,
               "best_baseline": None if base is None else base.iteration_ms,
               "best_baseline_name": None if base is None else base.source, "families": families,
               "speedup": None if base is None or w is None else base.iteration_ms / w.iteration_ms,
               "statuses": {s: sum(r.status == s for r in res.rows) for s in {r.status for r in res.rows}}}
        rows.append(row)
        print(f"baselines {name} r{ranks}: tune {row['tune']} {row['config']}; best baseline {row['best_baseline']} "
              f"({row['best_baseline_name']}); speed-up {row['speedup']}; gap {row['gap']}; {took:.0f} s", flush=True)
    ups = [r["speedup"] for r in rows if r["speedup"] is not None]
    return {"case_time_s": args.case_time, "rows": rows,
            "speedup": {"mean": statistics.fmean(ups), "median": statistics.median(ups), "min": min(ups), "max": max(ups),
                        "geomean": statistics.geometric_mean(ups)} if ups else None}


def time_target(args) -> dict:
    """The command on 80 layers, 64 ranks, 3 sizes, timed from the outside."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for prof in profiles("70b-128k"):
            path = Path(d) / f"{prof.name}.json"
            save_layers(prof, path)
            paths += ["-l", str(path)]
        for limit in args.limits:
            cmd = [sys.executable, "-m", "zbsearch", "tune", *paths, "-r", "64", "--memory", "80GiB", "-g", "1024",
                   "--optimizer", "mixed", "--sharded", "--intra-gbs", "150", "--inter-gbs", "25", "--memory-gbs",
                   "2000", "-t", str(limit), "--json"]
            t0 = time.monotonic()
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=d, env=ENV)
            wall = time.monotonic() - t0
            if r.returncode:
                raise SystemExit(r.stderr)
            doc = json.loads(r.stdout)
            w = doc["rows"][doc["best"]] if doc["best"] is not None else None
            base = min((x for x in doc["rows"] if x["source"] != "tune" and x["iteration_ms"]),
                       key=lambda x: x["iteration_ms"], default=None)
            rows.append({"time_limit_s": limit, "wall_s": wall, "iteration_ms": w and w["iteration_ms"],
                         "config": w and {k: w[k] for k in ("pp", "dp", "microbatch_size", "microbatches", "placement",
                                                             "recompute")},
                         "bound": doc["lower_bound_ms"], "gap": doc["gap"],
                         "best_baseline": base and base["iteration_ms"],
                         "statuses": {s: sum(x["status"] == s for x in doc["rows"]) for s in {x["status"] for x in
                                                                                               doc["rows"]}}})
            print(f"time -t {limit}: {wall:.1f} s wall; {rows[-1]['iteration_ms']} {rows[-1]['config']}; gap "
                  f"{rows[-1]['gap']}", flush=True)
    return {"model": "70b-128k", "ranks": 64, "global_batch": 1024, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="exact,baselines,time")
    ap.add_argument("--plan-time", type=float, default=1.0, help="exact: seconds per configuration's plan (of work "
                    "on the work clock)")
    ap.add_argument("--wall", action="store_true", help="exact: plan on the wall clock, not the work clock")
    ap.add_argument("--grids", default="", help="exact: these grids only (indices, e.g. 0,1,2)")
    ap.add_argument("--save-as", default="", help="save the section under this key (to merge runs of parts)")
    ap.add_argument("--case-time", type=float, default=120.0, help="baselines: tune's time limit per case")
    ap.add_argument("--cases", type=int, default=0, help="baselines: the first N cases only")
    ap.add_argument("--limits", type=float, nargs="+", default=[60.0, 300.0], help="time: tune's time limits")
    args = ap.parse_args()
    for name in args.only.split(","):
        t0 = time.monotonic()
        got = {"exact": exact, "baselines": baselines, "time": time_target}[name](args)
        got["section_s"] = time.monotonic() - t0
        got["load_average"] = os.getloadavg()
        _store(args.save_as or name, got)


if __name__ == "__main__":
    main()
