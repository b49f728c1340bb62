"""The planner: exactness, baselines, predictions against runs, solve time, per-layer sums.

Sections (``--only`` runs some; each is saved into bench/results/plan.json as it finishes):

* ``units``: a per-layer profile of the built-in GPT (large vocabulary) against the stage
  profiler on the same cuts, measured in interleaved rounds and pooled: each stage's F, B, W,
  BW and activation memory composed from its units (``zbsearch.planner.compose``) over what
  the stage measured.
* ``exact``: a generated Llama-like model of 12 units (10 layers), 4 ranks, m=8, one stage per
  rank and V: every cut solved by the solver, against the plan (value within 1% of the best,
  bound never above it).
* ``recompute``: the same with recomputation, on a generated family (random unit costs and
  memory, full recomputation and selective on some, 7 to 10 units, one stage per rank on 3 or 4
  ranks or a V on 2 or 3, m of 3 to 6, a budget a little above the largest static memory of any cut):
  every cut solved by ``solve(recompute="auto")`` at the same budget against ``plan(recompute=
  "auto")``; every cut whose bound is under the best value solved again for longer, to tell
  whether the gap is the plan's or the bound's.
* ``small``: smaller members of that family (5 or 6 units, 2 ranks, m = 3, on a grid): every
  feasible cut's exact optimum over every order and choice of recomputation (CP-SAT, the tests'
  oracle; needs ortools), against its key and the plan.
* ``baselines``: generated Llama-like models (32 layers, hidden 4096, vocabularies 32k, 128k,
  256k), p = 4 and 8, m = 2p, 4p, 8p, 80 GiB per rank, mixed precision: the plan against the even
  split, torchtitan's default and Megatron's, each solved at the same budget.
* ``emulated``: plan and even split run by the runtime with emulated stages (p=4), each step
  timed barrier to barrier against the predicted makespan: on the generated profile, and on
  the emulated stages as the stage profiler measures them (what a sleeping pass costs with the
  runtime's work around it).
* ``real``: real passes on CPU, p=2, a GPT whose head costs several layers: both ranks measure
  the per-layer profile at once, in rounds interleaved with steps of the plan and the even
  split (round-robin); measured speed-up against the one predicted on the pooled rounds.
* ``time``: the ``zbsearch plan`` command, timed from the outside (the process's start to its
  end: imports, loading, the plan and writing it): 32 layers on p=8 at m=32 (60 s), 80 layers on
  p=16 at m=64 (300 s), and 32 layers on p=8 at m=32 with ``--recompute auto`` (60 s).
* ``torchtitan`` (with ``--torchtitan-path``): the torchtitan baseline against torchtitan's own
  ``_generate_llm_fqn_per_model_part``, an exported plan's overrides through torchtitan's
  ``ConfigManager``, and its stage-to-rank mapping against torchtitan's.

Run: PYTHONPATH=. python bench/plan.py [--only units,exact,...] [--torchtitan-path DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, machine, save_section
from pipeline import launch, ours, round_robin

import zbsearch as zb
from tests.helpers.layers import on_grid, random_layers
from zbsearch.formats.layers import LayerProfile
from zbsearch.formats.trace import Trace
from zbsearch.planner import Cut, baseline_cuts, llama_layers, plan, stage_profile
from zbsearch.planner.compose import activation_need, static_bytes
from zbsearch.planner.search import Cuts, compositions
from zbsearch.pooling import pool_layers

OUT = RESULTS / "plan.json"
GIB = 2**30
LLAMA = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, microbatch_size=1)


def _store(key: str, value) -> None:
    """Save one section into the results, with the commit it measured (sections are rerun apart)."""
    save_section(OUT, key, {**value, "commit": machine()["commit"]})


def _solve_cut(layers, cut, m, budget, optimizer, seconds, milp=True):
    limit = [budget - s for s in static_bytes(layers, cut, optimizer)]
    if any(n > x for n, x in zip(activation_need(layers, cut), limit)):
        return None
    try:
        return zb.solve(stage_profile(layers, cut), m, limit, chunks=cut.chunks, time_limit=seconds, milp=milp)
    except zb.ZbError:
        return None


_REAL_GPT = dict(layers=6, hidden=128, heads=4, seq=64, vocab=6144, microbatch_size=4)


def _real_model(args) -> dict:
    """The real section's GPT: ``_REAL_GPT`` with ``--real-model`` (``key=value,...``) over it."""
    cfg = dict(_REAL_GPT)
    for item in filter(None, (args.real_model or "").split(",")):
        key, _, value = item.partition("=")
        if key not in cfg:
            raise SystemExit(f"--real-model: unknown key {key!r}; use {', '.join(cfg)}")
        cfg[key] = int(value)
    return cfg


# -- units -----------------------------------------------------------------------------------------
_UNIT_CUTS = ((4, 4), (6, 2), (2, 2, 2, 2))


def units(args) -> dict:
    """The per-layer profile and the stage profiler on the same cuts, in interleaved rounds (each
    round every measurement once, the order reversed every other round) so that the machine's
    drift falls on both alike; each pooled over the rounds (medians), then composed against
    measured."""
    import torch

    from zbsearch.models import GPTConfig
    from zbsearch.pooling import pool_profiles
    from zbsearch.profiler import Settings, builtin_gpt, profile_layers, profile_one_device, unit_kinds
    from zbsearch.profiler.links import estimate_link

    cfg = GPTConfig(**_REAL_GPT, stages=2)
    settings = Settings(threads=1, repeat=args.repeat, rounds=1)
    u = cfg.units()
    link = estimate_link(torch.device("cpu"))
    specs = {"units": u}
    for counts in _UNIT_CUTS:
        per = [k - (s == 0) - (s == len(counts) - 1) for s, k in enumerate(counts)]
        specs[counts] = GPTConfig(**_REAL_GPT, stages=len(counts), cut=tuple(per))
    taken: dict = {k: [] for k in specs}
    for r in range(args.rounds):
        for key in (list(specs) if r % 2 == 0 else list(specs)[::-1]):
            if key == "units":
                taken[key].append(profile_layers(builtin_gpt(u), settings, kinds=unit_kinds(list(u.cut or ())), link=link))
            else:
                taken[key].append(profile_one_device(builtin_gpt(specs[key]), settings, link=link))
    layers = pool_layers(taken["units"])
    keys = ("t_f", "t_b", "t_w", "t_bw", "t_ff")
    rows = []
    for counts in _UNIT_CUTS:
        measured = pool_profiles(taken[counts])
        composed = stage_profile(layers, Cut(counts, "one"))
        per_round = [stage_profile(lp, Cut(counts, "one")) for lp in taken["units"]]
        for s, (a, b) in enumerate(zip(composed.stages, measured.stages)):
            ratio = {k: getattr(a, k) / getattr(b, k) for k in keys}
            rounds = {k: [getattr(c.stages[s], k) / getattr(m.stages[s], k) for c, m in zip(per_round, taken[counts])]
                      for k in keys}
            rows.append({"cut": list(counts), "stage": s, **ratio, "m_f": a.m_f / b.m_f if b.m_f else None,
                         "fb_w": (a.t_f + a.t_bw) / (b.t_f + b.t_bw),
                         "composed_ms": {k: getattr(a, k) for k in keys}, "measured_ms": {k: getattr(b, k) for k in keys},
                         "per_round": rounds})
            print(rows[-1]["cut"], s, {k: round(ratio[k], 3) for k in keys})
    return {"model": {**_REAL_GPT, "stages": 2}, "rounds": args.rounds, "units": layers.names, "rows": rows,
            "units_ms": {x.name: {k: getattr(x, k) for k in keys} for x in layers.units},
            "warnings": sorted({w for lp in taken["units"] for w in (lp.measured.warnings if lp.measured else [])})}


# -- exact -----------------------------------------------------------------------------------------
def exact(args) -> dict:
    L = llama_layers(10, vocab=128256, name="llama-l10-v128k", **LLAMA)
    out = []
    for placement, budget in (("one", 40 * GIB), ("v", 40 * GIB)):
        stages = 4 * (2 if placement == "v" else 1)
        t0 = time.monotonic()
        every = {}
        for counts in compositions(L.num_units, stages):
            res = _solve_cut(L, Cut(counts, placement), 8, budget, "mixed", args.cut_time)
            if res is not None:
                every[counts] = (res.info.value, res.info.status, res.info.lower_bound)
        enum_s = time.monotonic() - t0
        best = min(v for v, _, _ in every.values())
        best_cut = min(every, key=lambda c: every[c][0])
        p = plan(L, 4, 8, budget, placement=placement, optimizer="mixed", time_limit=args.exact_time)
        out.append({"placement": placement, "budget_gib": budget / GIB, "cuts": math.comb(L.num_units - 1, stages - 1),
                    "feasible": len(every), "optimal": sum(s == "optimal" for _, s, _ in every.values()),
                    "enumeration_s": enum_s, "best": best, "best_cut": list(best_cut),
                    "least_cut_bound": min(b for _, _, b in every.values()),
                    "plan": p.partition.value, "plan_cut": list(p.cut.counts), "plan_bound": p.partition.lower_bound,
                    "plan_gap": p.partition.gap, "plan_s": p.partition.time_s, "plan_solved": p.partition.cuts_solved,
                    "within_1pct": p.partition.value <= best * 1.01,
                    "bound_ok": p.partition.lower_bound <= best * (1 + 1e-9)})
        print(out[-1])
    return {"cut_time_s": args.cut_time, "plan_time_s": args.exact_time, "rows": out}


# -- recompute -------------------------------------------------------------------------------------
def _family(seed: int):
    """One generated instance of the recompute family (see the module)."""
    rng = random.Random(seed)
    placement = ("one", "v")[seed % 2]
    ranks = rng.choice((3, 4)) if placement == "one" else 3 if seed % 4 == 3 else 2
    units = rng.randint(7, 8) if ranks * (2 if placement == "v" else 1) > 4 else rng.randint(8, 10)
    L = random_layers(seed, units - 2, head=rng.uniform(2, 6), recompute=rng.choice(["full", "both"]))
    m = rng.randint(3, 6)
    stages = ranks * (2 if placement == "v" else 1)
    static = max(max(static_bytes(L, Cut(c, placement), "adamw")) for c in compositions(L.num_units, stages))
    return L, ranks, placement, m, static + rng.uniform(1.5, 3.0) * 1e6


def _where_the_gap_is(L, ranks, placement, m, budget, every, planned, seconds) -> dict:
    """Which side of the plan's gap is loose: every cut whose bound (its key, or the solver's
    from the enumeration) is under the best value known, solved again for ``seconds`` of work
    (the work clock, ``deterministic=True``: what these solves find is the same at any load,
    where in wall seconds a loaded machine's short solves leave the schedule side looser). The
    best value known then is the least of every solve and the plan; the bound known, the
    least over the feasible cuts of the best bound any of them proved."""
    space = Cuts(L, ranks, placement, m, budget, "adamw", "span", "auto")
    space.price_all(math.inf)
    bound = {c: max(ev.key, every[c][1]) for c, ev in space.seen.items() if ev.feasible and c in every}
    best = min(planned, min(v for v, _, _ in every.values()))
    again = 0
    for c in sorted(bound, key=bound.__getitem__):
        if bound[c] >= best * (1 - 1e-9):
            break
        ev = space.seen[c]
        res = zb.solve(ev.profile, m, ev.limit, chunks=ev.cut.chunks, time_limit=seconds, recompute="auto",
                       deterministic=True)
        bound[c] = max(bound[c], res.info.lower_bound)
        best = min(best, res.info.value)
        again += 1
    return {"long_solved": again, "best_known": best, "bound_known": min(bound.values())}


def recompute(args) -> dict:
    rows = []
    for seed in range(args.recompute_instances):
        L, ranks, placement, m, budget = _family(seed)
        stages = ranks * (2 if placement == "v" else 1)
        t0 = time.monotonic()
        every = {}
        for counts in compositions(L.num_units, stages):
            cut = Cut(counts, placement)
            limit = [budget - s for s in static_bytes(L, cut, "adamw")]
            if any(n > x for n, x in zip(activation_need(L, cut, "auto"), limit)):
                continue
            res = zb.solve(stage_profile(L, cut), m, limit, chunks=cut.chunks, time_limit=args.recompute_cut_time,
                           recompute="auto")
            every[counts] = (res.info.value, res.info.lower_bound, res.info.recomputed)
        plain = sum(all(n <= x for n, x in zip(activation_need(L, Cut(c, placement)),
                                                [budget - s for s in static_bytes(L, Cut(c, placement), "adamw")]))
                    for c in every)
        enum_s = time.monotonic() - t0
        best_cut = min(every, key=lambda c: every[c][0])
        best = every[best_cut][0]
        p = plan(L, ranks, m, budget, placement=placement, time_limit=args.recompute_time, recompute="auto")
        part = p.partition
        assert p.schedule.solver is not None
        rows.append({"seed": seed, "units": L.num_units, "ranks": ranks, "placement": placement, "m": m,
                     "budget_mb": budget / 1e6, "cuts": math.comb(L.num_units - 1, stages - 1), "feasible": len(every),
                     "feasible_without": plain, "enumeration_s": enum_s, "best": best, "best_cut": list(best_cut),
                     "best_recomputed": every[best_cut][2], "plan": part.value, "plan_cut": part.units_per_stage,
                     "plan_recomputed": p.schedule.solver.recomputed, "plan_bound": part.lower_bound,
                     "plan_gap": part.gap, "plan_s": part.time_s, "plan_solved": part.cuts_solved,
                     "exhaustive": part.exhaustive, "ratio": part.value / best,
                     "within_1pct": part.value <= best * 1.01, "bound_ok": part.lower_bound <= best * (1 + 1e-9)})
        if args.recompute_long_time > 0:
            rows[-1].update(_where_the_gap_is(L, ranks, placement, m, budget, every, part.value, args.recompute_long_time))
        print({k: rows[-1][k] for k in ("seed", "units", "ranks", "placement", "m", "feasible", "ratio", "bound_ok",
                                        "plan_recomputed")})
    return {"cut_time_s": args.recompute_cut_time, "plan_time_s": args.recompute_time,
            "long_time_s": args.recompute_long_time, "long_clock": "work", "rows": rows,
            "within_1pct": sum(r["within_1pct"] for r in rows), "bound_ok": sum(r["bound_ok"] for r in rows)}


# -- small: the recompute family's gap against exact optima ------------------------------------------
def _small_member(seed: int):
    """A member of the recompute family small enough for the exact oracle: 5 or 6 units on 2
    ranks, m = 3, a budget where recomputation pays."""
    rng = random.Random(seed)
    L = on_grid(random_layers(seed, rng.randint(3, 4), head=rng.uniform(2, 6), recompute=rng.choice(["full", "both"])))
    static = max(max(static_bytes(L, Cut(c, "one"), "adamw")) for c in compositions(L.num_units, 2))
    return L, 2, "one", 3, float(round((static + rng.uniform(2.5, 4.0) * 1e6) / 8192) * 8192)


def small(args) -> dict:
    """Every feasible cut's exact optimum over every order and choice of recomputation (CP-SAT,
    the tests' oracle), against its key and the plan: which side of the gap is loose."""
    from tests.solver.oracle import cp_optimum_many

    rows = []
    for seed in range(args.small_instances):
        L, ranks, placement, m, budget = _small_member(seed)
        space = Cuts(L, ranks, placement, m, budget, "adamw", "span", "auto")
        space.price_all(math.inf)
        feasible = [ev for ev in space.seen.values() if ev.feasible]
        jobs = [(zb.CostModel.from_profile(ev.profile, ev.cut.stage_to_rank), m, [float(int(x)) for x in ev.limit], "span",
                 {"recompute": True}) for ev in feasible]  # type: ignore[arg-type]
        optima = cp_optimum_many(jobs, time_limit=args.small_oracle_time, processes=2)
        p = plan(L, ranks, m, budget, placement=placement, time_limit=args.small_plan_time, recompute="auto").partition
        best = min(r.value for r in optima)
        rows.append({"seed": seed, "units": L.num_units, "cuts": len(feasible), "proven": all(r.optimal for r in optima),
                     "keys": [ev.key for ev in feasible], "optima": [r.value for r in optima], "optimum": best,
                     "plan": p.value, "plan_bound": p.lower_bound, "plan_s": p.time_s,
                     "plan_side": p.value / best - 1, "bound_side": best / p.lower_bound - 1,
                     "worst_key": max(r.value / ev.key - 1 for ev, r in zip(feasible, optima))})
        print(rows[-1])
    return {"oracle_time_s": args.small_oracle_time, "plan_time_s": args.small_plan_time, "rows": rows}


# -- baselines -------------------------------------------------------------------------------------
def baselines(args) -> dict:
    rows = []
    for vocab in (32000, 128256, 256000):
        L = llama_layers(32, vocab=vocab, name=f"llama-l32-v{vocab}", **LLAMA)
        for p in (4, 8):
            for m in (2 * p, 4 * p, 8 * p):
                res = plan(L, p, m, 80 * GIB, optimizer="mixed", time_limit=args.baseline_time)
                part = res.partition
                base = {b.name: b.value for b in part.baselines}
                values = [v for v in base.values() if v is not None]
                even = min((b.value for b in part.baselines if b.name.startswith("even") and b.value), default=None)
                row = {"vocab": vocab, "p": p, "m": m, "plan": part.value, "placement": part.placement,
                       "cut": part.units_per_stage, "bound": part.lower_bound, "gap": part.gap, "baselines": base,
                       "best_baseline": min(values) if values else None,
                       "vs_best_baseline": min(values) / part.value if values else None,
                       "vs_even": even / part.value if even else None, "time_s": part.time_s,
                       "solved": part.cuts_solved, "exhaustive": part.exhaustive}
                rows.append(row)
                print({k: row[k] for k in ("vocab", "p", "m", "placement", "vs_best_baseline", "vs_even", "gap")})
    return {"time_limit_s": args.baseline_time, "budget_gib": 80, "optimizer": "mixed", "rows": rows}


# -- emulated --------------------------------------------------------------------------------------
def _emulated_worker(rank, world, send, scheds, iters, warmup):
    import torch

    from zbsearch.runtime import emulated_loss, emulated_stages

    torch.set_num_threads(1)
    runners = {}
    for name, path in scheds.items():
        sched = zb.load_schedule(path)
        x = torch.zeros(sched.num_microbatches, 16)
        stages = emulated_stages(sched.profile, sched.stage_to_rank, 1e-6, 16, 1.0)
        runners[name] = ours(rank, sched, stages, x, x, emulated_loss)
    got = round_robin(runners, iters, warmup)
    return {name: walls for name, (walls, _) in got.items()}


def _makespan(sched, profile=None) -> float:
    """The predicted first start to last end of ``sched`` (on ``profile``, default its own): what
    a step timed barrier to barrier takes, as ``round_robin`` times it."""
    from zbsearch.costs import CostModel
    from zbsearch.simulator import simulate

    prof = sched.profile if profile is None else profile
    return simulate(sched.rank_actions, CostModel.from_profile(prof, sched.stage_to_rank)).makespan


def _emulated_profile(sched, settings):
    """The emulated stages of ``sched`` as the stage profiler measures them (one process, one
    thread, the link between two local processes): what each sleeping pass costs with the
    runtime's own work around it."""
    import torch

    from zbsearch.profiler import ModelSpec, profile_one_device
    from zbsearch.runtime import emulated_loss, emulated_stages

    stages = emulated_stages(sched.profile, sched.stage_to_rank, 1e-6, 16, 1.0)
    x = torch.zeros(1, 16)
    spec = ModelSpec("emulated", list(stages), (x,), emulated_loss, x)
    return profile_one_device(spec, settings, placement=sched.profile.placement)


def emulated(args, tmp: Path) -> dict:
    from zbsearch.profiler import Settings

    rows = []
    settings = Settings(threads=1, repeat=args.repeat, rounds=args.rounds)
    for vocab, m in ((256000, 8), (128256, 16)):
        L = llama_layers(16, vocab=vocab, latency_ms=0.3, bandwidth_gb_s=1e6, name=f"llama-l16-v{vocab}", **LLAMA)
        res = plan(L, 4, m, 80 * GIB, optimizer="mixed", placement="one", time_limit=args.baseline_time)
        even = next(b for b in baseline_cuts(L, 4, "one") if b.name == "even")
        assert even.cut is not None
        ev = _solve_cut(L, even.cut, m, 80 * GIB, "mixed", args.baseline_time)
        assert ev is not None
        paths = {"plan": tmp / f"plan-{vocab}.json", "even": tmp / f"even-{vocab}.json"}
        zb.save_schedule(res.schedule, paths["plan"])
        zb.save_schedule(ev.schedule, paths["even"])
        scheds = {"plan": res.schedule, "even": ev.schedule}
        # what the emulated passes cost as profiled, measured before the runs
        measured_profile = {k: _emulated_profile(s, settings) for k, s in scheds.items()}
        walls = launch(_emulated_worker, 4, {k: str(v) for k, v in paths.items()}, args.iters, 2)
        span = {"plan": res.partition.value, "even": ev.info.value}
        row = {"vocab": vocab, "m": m, "plan_cut": res.partition.units_per_stage, "even_cut": list(even.cut.counts)}
        for k, sched in scheds.items():
            med = statistics.median(walls[k])
            pred = _makespan(sched)
            prof = measured_profile[k]
            profiled = _makespan(sched, prof)
            row[k] = {"predicted_span_ms": span[k], "predicted_ms": pred, "measured_ms": med, "ratio": med / pred,
                      "q1_q3": statistics.quantiles(walls[k], n=4)[::2], "span_ratio": med / span[k],
                      "profiled_ms": profiled, "profiled_ratio": med / profiled,
                      "profiled_link_ms": prof.t_comm, "pass_excess_ms": _excess(sched.profile, prof)}
        row["speedup_predicted"] = row["even"]["predicted_ms"] / row["plan"]["predicted_ms"]
        row["speedup_profiled"] = row["even"]["profiled_ms"] / row["plan"]["profiled_ms"]
        row["speedup_measured"] = row["even"]["measured_ms"] / row["plan"]["measured_ms"]
        rows.append(row)
        print(row)
    return {"iters": args.iters, "rows": rows}


def _excess(set_profile, measured) -> dict[str, float]:
    """Mean over stages of what each pass measured beyond the time it was set to sleep (ms)."""
    keys = ("t_f", "t_b", "t_w", "t_bw", "t_ff")
    a, b = set_profile.compute_only().stages, measured.stages
    return {k: statistics.fmean(getattr(y, k) - getattr(x, k) for x, y in zip(a, b)) for k in keys}


# -- real ------------------------------------------------------------------------------------------
def _real_worker(rank, world, send, args, link):
    """Each rank: rounds of (a per-layer profile, both ranks measuring every unit at once, as
    the pipeline's two ranks compute at once; then one step of each schedule, round-robin).
    The plan and the even split are solved on the first profile round; every round is pooled
    for the prediction. Rank 0 returns the profiles, the schedules and the steps."""
    import torch
    import torch.distributed as dist

    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
    from zbsearch.profiler import Settings, builtin_gpt, profile_layers, unit_kinds
    from zbsearch.profiler.links import LinkModel

    torch.set_num_threads(1)
    model = _real_model(args)
    cfg = GPTConfig(**model, stages=2)
    u = cfg.units()
    settings = Settings(threads=1, repeat=args.repeat, rounds=1)
    kinds = unit_kinds(list(u.cut or ()))

    def profile_round():
        mine = profile_layers(builtin_gpt(u), settings, kinds=kinds, link=LinkModel(**link))
        both = [None] * world
        dist.all_gather_object(both, mine.model_dump_json())
        return [LayerProfile.model_validate_json(x) for x in both]

    taken = profile_round()
    box = [None]
    if rank == 0:
        first = pool_layers(taken)
        res = plan(first, 2, args.real_m, None, placement=args.real_placement, time_limit=20)
        even = next(b for b in baseline_cuts(first, 2, "one") if b.name == "even")
        assert even.cut is not None
        ev = zb.solve(stage_profile(first, even.cut), args.real_m, None, time_limit=10)
        box = [{"plan": (res.schedule.model_dump_json(), list(res.partition.units_per_stage),
                         res.partition.placement, res.partition.value),
                "even": (ev.schedule.model_dump_json(), list(even.cut.counts), "one", ev.info.value)}]
    dist.broadcast_object_list(box, src=0)
    chosen = box[0]
    runners, cuts = {}, {}
    for name, (doc, counts, placement, _) in chosen.items():
        sched = zb.Schedule.model_validate_json(doc)
        ends = (0, len(counts) - 1)
        per = [k - (s in ends[:1]) - (s == ends[1]) for s, k in enumerate(counts)]
        stage_cfg = GPTConfig(**model, stages=sched.num_stages, cut=tuple(per))
        x, y = gpt_batch(stage_cfg, sched.num_microbatches)
        runners[name] = ours(rank, sched, gpt_stages(stage_cfg), x, y, gpt_loss)
        cuts[name] = (Cut(tuple(counts), placement), sched)
    got = {name: ([], []) for name in runners}
    loads = []
    for r in range(args.real_rounds):
        part = round_robin(runners, max(1, args.iters // args.real_rounds), 3 if r == 0 else 0)
        loads.append(os.getloadavg()[0])
        for name, (walls, traces) in part.items():
            got[name][0].extend(walls)
            got[name][1].extend(traces)
        taken.extend(profile_round())
    if rank != 0:
        return None
    return {"profiles": [p.model_dump_json() for p in taken], "chosen": chosen, "loads": loads,
            "walls": {k: w for k, (w, _) in got.items()},
            "traces": {k: [t.model_dump_json() for t in tr] for k, (_, tr) in got.items()}}


def real(args, tmp: Path) -> dict:
    import torch

    from zbsearch.pass_times import compare_pass_times
    from zbsearch.profiler.links import estimate_link

    link = estimate_link(torch.device("cpu"))
    got = launch(_real_worker, 2, args, {"latency_ms": link.latency_ms, "bandwidth_gb_s": link.bandwidth_gb_s,
                                         "how": link.how})
    profiles = [LayerProfile.model_validate_json(x) for x in got["profiles"]]
    pooled = pool_layers(profiles)
    row = {"model": _real_model(args), "m": args.real_m, "profile_rounds": len(profiles) // 2, "loads": got["loads"],
           "link": {"latency_ms": link.latency_ms, "bandwidth_gb_s": link.bandwidth_gb_s},
           "warnings": sorted({w for p in profiles for w in (p.measured.warnings if p.measured else [])})}
    for name, (doc, counts, placement, value) in got["chosen"].items():
        sched = zb.Schedule.model_validate_json(doc)
        cut = Cut(tuple(counts), placement)
        on_pooled = sched.model_copy(update={"profile": stage_profile(pooled, cut)})
        walls = got["walls"][name]
        traces = [Trace.model_validate_json(t) for t in got["traces"][name]]
        pred, first_pred = _makespan(on_pooled), _makespan(sched)
        med = statistics.median(walls)
        row[name] = {"cut": list(counts), "placement": placement, "predicted_ms": pred,
                     "predicted_first_round_ms": first_pred, "predicted_span_first_round_ms": value,
                     "measured_ms": med, "ratio": med / pred, "ratio_first_round": med / first_pred,
                     "q1_q3": statistics.quantiles(walls, n=4)[::2],
                     "passes": [{"rank": x.rank, "op": x.op.value, "measured_ms": x.measured_ms,
                                 "predicted_ms": x.predicted_ms, "ratio": x.ratio}
                                for x in compare_pass_times(on_pooled, traces)]}
    row["plan_cut"], row["even_cut"] = row["plan"]["cut"], row["even"]["cut"]
    row["speedup_predicted"] = row["even"]["predicted_ms"] / row["plan"]["predicted_ms"]
    row["speedup_predicted_first_round"] = row["even"]["predicted_first_round_ms"] / row["plan"]["predicted_first_round_ms"]
    row["speedup_measured"] = row["even"]["measured_ms"] / row["plan"]["measured_ms"]
    row["speedup_error"] = row["speedup_measured"] / row["speedup_predicted"] - 1
    row["units_pooled"] = {u.name: {k: getattr(u, k) for k in ("t_f", "t_b", "t_w", "t_bw", "t_ff")} for u in pooled.units}
    print({k: v for k, v in row.items() if k not in ("plan", "even", "units_pooled", "warnings")})
    for k in ("plan", "even"):
        print(k, {x: v for x, v in row[k].items() if x != "passes"})
        for x in row[k]["passes"]:
            print("   ", x)
    return row


# -- time ------------------------------------------------------------------------------------------
def solve_time(args, tmp: Path) -> dict:
    """The plan command end to end, timed from outside its process."""
    from zbsearch.formats.layers import save_layers

    rows = []
    for layers, p, m, limit, rc in ((32, 8, 32, 60.0, "none"), (80, 16, 64, 300.0, "none"), (32, 8, 32, 60.0, "auto")):
        L = llama_layers(layers, vocab=128256, name=f"llama-l{layers}-v128k", **LLAMA)
        path, out = tmp / f"time-l{layers}.json", tmp / f"time-plan-l{layers}-{rc}.json"
        save_layers(L, path)
        cmd = [sys.executable, "-m", "zbsearch", "plan", "-l", str(path), "-r", str(p), "-m", str(m), "--memory",
               "80GiB", "--optimizer", "mixed", "-t", str(limit), "--recompute", rc, "-o", str(out)]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        wall = time.monotonic() - t0
        if r.returncode:
            rows.append({"layers": layers, "p": p, "m": m, "recompute": rc, "error": r.stderr.strip()[-500:]})
            continue
        sched = zb.load_schedule(out)
        part = sched.partition
        assert part is not None and sched.solver is not None
        values = [b.value for b in part.baselines if b.value is not None]
        rows.append({"layers": layers, "p": p, "m": m, "recompute": rc, "time_limit_s": limit, "wall_s": wall,
                     "plan_s": part.time_s, "value": part.value, "bound": part.lower_bound, "gap": part.gap,
                     "placement": part.placement, "solved": part.cuts_solved, "bounded": part.cuts_bounded,
                     "recomputed": sched.solver.recomputed,
                     "vs_best_baseline": min(values) / part.value if values else None})
        print(rows[-1])
    return {"rows": rows, "measured": "the zbsearch plan command, process start to end"}


# -- torchtitan ------------------------------------------------------------------------------------
_TT_CHECK = r'''
import json, sys
import torch
from torchtitan.distributed.pipeline_parallel import (_generate_llm_fqn_per_model_part, _get_pp_rank_to_stage_indices_mapping,
                                                      _split_module)
from torchtitan.config.manager import ConfigManager

class Decoder(torch.nn.Module):  # the children of torchtitan's decoder: layers keyed by position
    def __init__(self, n):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(8, 4)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(n)})
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 8)

cases, exports = json.loads(sys.stdin.read())
out = {"rules": [], "exports": []}
for L, S, ours in cases:
    theirs = _generate_llm_fqn_per_model_part(S, L, 1, 1)
    out["rules"].append([L, S, [len([n for n in st if n.startswith("layers.")]) for st in theirs] == ours])
for names, args, fqns, stage_to_rank, P, layers_per_stage in exports:
    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *args])
    par = cfg.parallelism
    mapping = {}
    for r in range(P):
        for s in _get_pp_rank_to_stage_indices_mapping(r, P, par.pipeline_parallel_schedule, len(fqns)):
            mapping[s] = r
    model = Decoder(sum(layers_per_stage))
    kept = [list(_split_module(model, part).layers.keys()) for part in par.module_fqns_per_model_part]
    out["exports"].append({"names": names, "fqns_equal": par.module_fqns_per_model_part == fqns,
                           "placement_equal": [mapping[s] for s in range(len(fqns))] == stage_to_rank,
                           "split_equal": [len(k) for k in kept] == layers_per_stage
                           and sum(kept, []) == [str(i) for i in range(sum(layers_per_stage))],
                           "schedule": par.pipeline_parallel_schedule, "csv": par.pipeline_parallel_schedule_csv})
print(json.dumps(out))
'''


def torchtitan(args, tmp: Path) -> dict:
    from zbsearch.planner.torchtitan import torchtitan_export

    cases = []
    for L in range(2, 41, 3):
        for S in (2, 3, 4, 8, 16):
            layers = llama_layers(L, vocab=1000, hidden=64, heads=4, seq=16)
            b = next(x for x in baseline_cuts(layers, S, "one") if x.name == "torchtitan")
            if b.cut is not None:
                cases.append([L, S, [k - (s == 0) - (s == S - 1) for s, k in enumerate(b.cut.counts)]])
    exports = []
    for placement in ("one", "v"):
        L = llama_layers(12, vocab=128256, **LLAMA)
        res = plan(L, 4, 8, 80 * GIB, placement=placement, optimizer="mixed", time_limit=10)
        # the same cut of layers named otherwise: torchtitan names them by position all the same
        units = [u.model_copy(update={"name": f"block_{i}"}) if u.kind == "layer" else u for i, u in enumerate(L.units, -1)]
        renamed = res.schedule.model_copy(deep=True)
        assert renamed.partition is not None
        rename = dict(zip(L.names, [u.name for u in units]))
        renamed.partition.units = [rename[n] for n in renamed.partition.units]
        renamed.partition.stages = [[rename[n] for n in st] for st in renamed.partition.stages]
        for names, sched in (("as profiled", res.schedule), ("renamed block_i", renamed)):
            ex = torchtitan_export(sched, str(tmp / f"{placement}.csv"))
            (tmp / f"{placement}.csv").write_text(ex.csv)
            exports.append([names, ex.args, ex.module_fqns_per_model_part, sched.stage_to_rank, 4,
                            sched.partition.layers_per_stage])
    env = {**os.environ, "PYTHONPATH": args.torchtitan_path}
    r = subprocess.run([sys.executable, "-c", _TT_CHECK], input=json.dumps([cases, exports]), capture_output=True,
                       text=True, env=env, cwd=tmp)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1]}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {"rule_cases": len(got["rules"]), "rule_equal": sum(ok for _, _, ok in got["rules"]),
            "rule_mismatches": [[L, S] for L, S, ok in got["rules"] if not ok], "exports": got["exports"],
            "torchtitan_path": args.torchtitan_path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="units,real,emulated,exact,recompute,small,baselines,time,torchtitan")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cut-time", type=float, default=1.0, help="seconds per cut when enumerating")
    ap.add_argument("--exact-time", type=float, default=60.0)
    ap.add_argument("--baseline-time", type=float, default=20.0)
    ap.add_argument("--recompute-instances", type=int, default=12, help="instances of the recompute family")
    ap.add_argument("--recompute-cut-time", type=float, default=0.3, help="seconds per cut, recompute family")
    ap.add_argument("--recompute-time", type=float, default=10.0, help="plan seconds, recompute family")
    ap.add_argument("--recompute-long-time", type=float, default=3.0,
                    help="seconds of work (the work clock) per cut solved again where its bound is under "
                    "the best value (0: none)")
    ap.add_argument("--small-instances", type=int, default=10, help="small members of the recompute family")
    ap.add_argument("--small-oracle-time", type=float, default=120.0, help="small: CP-SAT seconds per cut")
    ap.add_argument("--small-plan-time", type=float, default=5.0, help="small: plan seconds")
    ap.add_argument("--real-placement", default="one")
    ap.add_argument("--real-m", type=int, default=8, help="microbatches of the real runs")
    ap.add_argument("--real-model", default="", help="real runs: the GPT's sizes over the default, key=value,... "
                    "(layers, hidden, heads, seq, vocab, microbatch_size)")
    ap.add_argument("--real-rounds", type=int, default=4,
                    help="real runs: rounds of steps, each followed by a per-layer profile round")
    ap.add_argument("--torchtitan-path", default=None, help="PYTHONPATH with torchtitan and its imports")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in args.only.split(","):
            t0 = time.monotonic()
            if name == "units":
                got = units(args)
            elif name == "exact":
                got = exact(args)
            elif name == "baselines":
                got = baselines(args)
            elif name == "emulated":
                got = emulated(args, tmp)
            elif name == "real":
                got = real(args, tmp)
            elif name == "time":
                got = solve_time(args, tmp)
            elif name == "recompute":
                got = recompute(args)
            elif name == "small":
                got = small(args)
            elif name == "torchtitan":
                if not args.torchtitan_path:
                    continue
                got = torchtitan(args, tmp)
            else:
                raise SystemExit(f"unknown section {name!r}")
            got["section_s"] = time.monotonic() - t0
            got["load_average"] = os.getloadavg()
            _store(name, got)


if __name__ == "__main__":
    main()
