"""Memory below 1F1B's: the V building blocks, recomputation, and the bounds that certify them.

Parts (``--parts``):

* controllable: V-Half and V-Min (arXiv 2405.15362), built here from the paper's building
  blocks and timed by the simulator, against the bubble rates published for the authors' own
  generator (unit costs per chunk pass, no communication, B frees nothing and W frees all), at
  (p, m) = (4, 8), (8, 24), (16, 64) and on the paper's 1.5B and 6.2B profiles (p = 8, m = 24).
  Then ``solve`` on the V placement at each schedule's own peak memory: its span against the
  schedule's (target: at most), its bound and gap.
* recompute: ``solve --recompute auto`` at 0.5p and 1p, one stage per rank, on the paper's 1.5B
  and 6.2B profiles (p = 8, m = 24; recomputation costs derived from the paper's formulas, see
  ``zbsearch/profiles/paper/generate.py``), once per selective recomputation the runtime runs:
  the attention cores (the bundled profiles: Megatron's selective), the MLPs, and none (full
  recomputation only); against 1F1B with full recomputation, fused (Megatron's) and with its
  backwards split, and ZB-H1 with full recomputation, each at no limit of its own (targets:
  1.2x faster than 1F1B with full recomputation, gap at most 3%), and ``--recompute full`` and
  ``none`` beside them.
* scale: p = 32, m = 256 (the 28.3B profile) with ``--recompute auto`` at 0.5p and 1p:
  the solve's own time against its 5 s limit (target: a valid schedule within 5 s).
* oracle: generated small instances with recomputation offered (full, and selective on every
  other one), limits from the least any schedule needs with recomputation to 1.5 times the
  least without: the exact optimum over every order and choice of recomputation (CP-SAT);
  every bound of ``zbsearch.bounds`` against it (a bound above it is unsound), and ``solve``'s
  claims (value, bound, a false ``optimal``).
* frontier: ``zbsearch frontier`` on the 1.5B profile, one stage per rank and the V, with and
  without recomputation.
* real: real passes on 2 local ranks (CPU, the built-in GPT, at a sequence length where each
  layer's attention probabilities are about half of what it keeps): profiled with
  recomputation in both selective modes (``Settings(recompute=True, selective=...)``, a profiler
  round of each before and after each round of steps, pooled); ``solve --recompute auto`` at
  0.75p (full and attention-core recomputation offered), the same with selective recomputation
  only, of the attention cores and of the MLPs, each at a limit a little over halfway from one
  microbatch at a time to 1F1B's memory, and ``zb-h1-recompute``, ``1f1b-recompute`` and
  ``1f1b-split-recompute``, run by the runtime; per schedule the measured iteration (the trace's
  makespan) against the prediction (target: within 5%), each rank's peak activation bytes, after
  any pass and inside the passes (the meter's), against the prediction, and the gradients of two
  steps against the same schedule without its recompute passes, from the same weights (target:
  equal).

Prints tables and saves bench/results/recompute.json; ``python bench/report.py recompute``
renders it. Run: PYTHONPATH=. python bench/recompute.py [--time-limit 30] [--count 40]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import save
from tests.solver.oracle import FAMILIES, cp_optimum_many, random_instance, with_recompute
from zbsearch import Profile, StageCost, build_classic, find_problem, load_profile, timeline
from zbsearch.bounds import memory_makespan_lower_bound, memory_span_lower_bound
from zbsearch.costs import CostModel
from zbsearch.solver import frontier, smallest_feasible_limit, solve

TOL = 1e-6
# bubble rates published for the authors' generator (unit costs), with the memory it reaches
PUBLISHED = {("v-half", 4, 8): 0.094, ("v-half", 8, 24): 0.106, ("v-half", 16, 64): None,
             ("v-min", 4, 8): None, ("v-min", 8, 24): 0.158, ("v-min", 16, 64): 0.133}


def _unit(p: int) -> Profile:
    """F = B = W = 1 per chunk pass (2 per profile stage, halved on the V), B frees nothing."""
    st = StageCost(t_f=2.0, t_b=2.0, t_w=2.0, m_f=2.0, m_b=0.0, m_w=-2.0)
    return Profile(name=f"unit-p{p}", memory_unit="activations", stages=[st] * p)


def controllable_part(args) -> dict:
    cases = [(kind, _unit(p), m) for (kind, p, m) in PUBLISHED]
    cases += [(kind, load_profile(name), 24) for name in ("1.5b-m24", "6.2b-m24") for kind in ("v-half", "v-min")]
    rows = []
    for kind, prof, m in cases:
        p = prof.num_ranks
        sched = build_classic(kind, prof, m)
        assert find_problem(sched) is None
        pred = sched.predicted
        peak = max(pred.peak_memory)
        limit = [peak] * p  # the schedule's own memory on every rank
        res = solve(prof, m, limit, chunks=2, time_limit=args.time_limit)
        unit = CostModel.from_profile(prof, list(sched.stage_to_rank)).activation_unit(0)  # M_B of a rank
        published = PUBLISHED.get((kind, p, m)) if prof.name.startswith("unit") else None
        pub_span = None if published is None else max(timeline(sched).busy) / (1 - published)
        row = {"kind": kind, "profile": prof.name, "p": p, "m": m, "memory": peak, "memory_p": peak / (p * unit),
               "published_bubble": published, "published_span": pub_span, "built_span": max(pred.span),
               "built_bubble": pred.bubble_rate, "solve_span": res.info.value, "bound": res.info.lower_bound,
               "gap": res.info.gap, "status": res.info.status, "construction": res.info.construction,
               "time_s": res.info.time_s}
        # the reference: the schedule built here from the paper's description and re-simulated on
        # the same costs (the published rates are rounded to 3 digits, and serve as a check of it)
        row["met"] = res.info.value <= row["built_span"] * (1 + TOL)
        rows.append(row)
        print(f"{kind:<7} {prof.name:<16} p={p:<2} m={m:<3} memory {row['memory_p']:.4g}p  published "
              f"{'-' if published is None else f'{published:.3f}'}  built {row['built_bubble']:.4f} span "
              f"{row['built_span']:.6g}  solve {res.info.value:.6g} bound {res.info.lower_bound:.6g} "
              f"({res.info.gap:.2%}, {res.info.status})  {'met' if row['met'] else 'MISSED'}", flush=True)
    return {"cases": rows, "met": sum(r["met"] for r in rows), "n": len(rows)}


# the classic kinds with every microbatch recomputed: 1F1B fused (Megatron's), 1F1B with its
# backwards split (the fair baseline for schedules with split backwards) and ZB-H1
RECOMPUTING = ("1f1b-recompute", "1f1b-split-recompute", "zb-h1-recompute")
# what selective recomputation the profile offers: the attention cores (the bundled profiles,
# Megatron's selective), the MLPs (the same formulas, ``paper_profile(..., "mlp")``), or none
SELECTIVE = ("attention", "mlp", "none")


def _paper(name: str, selective: str) -> Profile:
    """The paper's profile with its selective recomputation in the mode ``selective``, or none."""
    from zbsearch.profiles.paper.generate import paper_profile

    model, _, m = name.rpartition("-m")
    prof = Profile.model_validate(paper_profile(model, int(m), "attention" if selective == "none" else selective))
    if selective == "none":
        stages = [st.model_copy(update={"t_fs": None, "t_rs": None, "m_fs": None}) for st in prof.stages]
        prof = prof.model_copy(update={"stages": stages, "selective": None, "name": prof.name + "-no-rs"})
    return prof


def recompute_part(args) -> dict:
    rows = []
    for name in ("1.5b-m24", "6.2b-m24"):
        base = {k: max(build_classic(k, load_profile(name), 24).predicted.span) for k in (*RECOMPUTING, "1f1b")}
        runs = [(sel, "auto", limit) for limit in ("0.5p", "1p") for sel in SELECTIVE]
        runs += [("none", "full", "0.5p"), ("none", "none", "0.5p"), ("none", "none", "1p")]
        for selective, mode, limit in runs:
            prof = _paper(name, selective)
            t0 = time.monotonic()
            res = solve(prof, 24, limit, recompute=mode, time_limit=args.time_limit)
            wall = time.monotonic() - t0
            info = res.info
            row = {"profile": name, "selective": selective, "mode": mode, "limit": limit, "span": info.value,
                   "bound": info.lower_bound, "gap": info.gap, "status": info.status, "recomputed": info.recomputed,
                   "rs": sum(a.op.value == "RS" for r in res.schedule.rank_actions for a in r),
                   "peak": max(res.timeline.peak_memory), "construction": info.construction, "time_s": info.time_s,
                   "wall_s": wall, "classic": base,
                   **{f"vs_{k}": base[k] / info.value for k in RECOMPUTING}}
            rows.append(row)
            print(f"{name:<9} {mode:<4} selective {selective:<9} {limit:<4} span {info.value:9.6g} bound "
                  f"{info.lower_bound:9.6g} gap {info.gap:6.2%} recomputed {info.recomputed:3} ({row['rs']} RS) "
                  + " ".join(f"x{row['vs_' + k]:.3f} vs {k}" for k in RECOMPUTING) + f"  {info.time_s:.1f}s", flush=True)
    return {"cases": rows}


def scale_part(args) -> dict:
    prof = load_profile("28.3b-m256")
    rows = []
    for limit in ("0.5p", "1p"):
        t0 = time.monotonic()
        res = solve(prof, 256, limit, recompute="auto", time_limit=5)
        wall = time.monotonic() - t0
        rows.append({"limit": limit, "span": res.info.value, "bound": res.info.lower_bound, "gap": res.info.gap,
                     "time_s": res.info.time_s, "wall_s": wall, "valid": find_problem(res.schedule) is None,
                     "recomputed": res.info.recomputed})
        print(f"p=32 m=256 {limit}: span {res.info.value:.6g} gap {res.info.gap:.2%} solve {res.info.time_s:.2f} s "
              f"(call {wall:.2f} s), valid {rows[-1]['valid']}", flush=True)
    return {"cases": rows}


def _selective_only(prof: Profile) -> Profile:
    """``prof`` offering selective recomputation only (no R)."""
    return prof.model_copy(update={"stages": [st.model_copy(update={"t_fc": None, "t_r": None, "t_rf": None, "m_fc": None})
                                              for st in prof.stages]})


def _real_worker(rank, world, send, args) -> dict | None:
    import os
    import statistics

    import torch
    import torch.distributed as dist

    from bench.pipeline import ours, round_robin
    from zbsearch import Schedule
    from zbsearch.actions import Op
    from zbsearch.costs import CostModel
    from zbsearch.idle_time import measure_idle_time
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
    from zbsearch.pass_times import compare_pass_times
    from zbsearch.pooling import pool_profiles
    from zbsearch.profiler import Settings, builtin_gpt, profile_distributed
    from zbsearch.runtime import PipelineRuntime

    torch.set_num_threads(1)
    cfg = GPTConfig(layers=args.real_layers, hidden=args.real_hidden, heads=args.real_heads, seq=args.real_seq, vocab=256,
                    microbatch_size=args.real_batch, stages=world)
    modes = ("attention", "mlp")

    def profile_round(mode: str) -> Profile:
        settings = Settings(warmup=2, repeat=args.real_repeat, rounds=1, threads=1, recompute=True, selective=mode)
        got = profile_distributed(builtin_gpt(cfg), settings)
        box = [got.model_dump_json() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return Profile.model_validate_json(box[0])

    taken = {mode: [profile_round(mode)] for mode in modes}
    m = args.real_m
    box: list = [None]
    if rank == 0:
        first = taken["attention"][0]
        texts = [solve(first, m, "0.75p", recompute="auto", time_limit=args.real_solve_time).schedule.model_dump_json()]
        for mode in modes:
            # selective recomputation only, at a limit where a microbatch recomputed selectively lets a
            # rank hold another: a little over halfway from one microbatch at a time to 1F1B's memory
            only = _selective_only(taken[mode][0])
            cost = CostModel.from_profile(only, list(range(world)))
            least = smallest_feasible_limit(cost, m, "auto")
            peak = build_classic("1f1b", only, m).predicted.peak_memory
            limit = [lo + 0.55 * (hi - lo) for lo, hi in zip(least, peak)]
            texts.append(solve(only, m, limit, recompute="auto", time_limit=args.real_solve_time).schedule.model_dump_json())
        box = [texts]
    dist.broadcast_object_list(box, src=0)
    schedules = {"zb auto 0.75p": Schedule.model_validate_json(box[0][0]),
                 "zb auto attention-core RS only": Schedule.model_validate_json(box[0][1]),
                 "zb auto MLP RS only": Schedule.model_validate_json(box[0][2]),
                 "zb-h1-recompute": build_classic("zb-h1-recompute", taken["attention"][0], m),
                 "1f1b-recompute": build_classic("1f1b-recompute", taken["attention"][0], m),
                 "1f1b-split-recompute": build_classic("1f1b-split-recompute", taken["attention"][0], m)}
    mode_of = {name: "mlp" if "MLP" in name else "attention" for name in schedules}
    inputs, targets = gpt_batch(cfg, m, seed=0)
    runners = {name: ours(rank, sched, gpt_stages(cfg), inputs, targets, gpt_loss) for name, sched in schedules.items()}
    got: dict[str, tuple[list, list]] = {name: ([], []) for name in runners}
    loads = []
    for r in range(args.real_rounds):
        part = round_robin(runners, args.real_steps, 2 if r == 0 else 0)
        loads.append(os.getloadavg()[0])
        for name, (walls, traces) in part.items():
            got[name][0].extend(walls)
            got[name][1].extend(traces)
        for mode in modes:
            taken[mode].append(profile_round(mode))
    pooled = {mode: pool_profiles(taken[mode]) for mode in modes}

    # gradients: two steps of each schedule and of it without its recompute passes, same weights;
    # the meter's peak in the second step of each
    exact, meter_peaks = {}, {}
    for name, sched in schedules.items():
        plain = Schedule.build(sched.kind + "-plain", sched.profile, m, list(sched.stage_to_rank),
                               [[a for a in row if a.op not in (Op.R, Op.RS)] for row in sched.rank_actions])
        grads, peak = [], 0
        for sc in (sched, plain):
            stages = gpt_stages(cfg)
            mine = {s: stages[s] for s in range(sc.num_stages) if sc.stage_to_rank[s] == rank}
            with PipelineRuntime(sc, mine, gpt_loss, timeout=120) as rt:
                for _ in range(2):
                    rt.step(inputs if 0 in mine else None, targets if sc.num_stages - 1 in mine else None)
                if sc is sched:
                    peak = rt.peak_activation_bytes
            grads.append([q.grad for st in mine.values() for q in st.parameters()])
        same = all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(*grads))
        box = [None] * world
        dist.all_gather_object(box, (same, peak))
        exact[name] = all(x for x, _ in box)
        meter_peaks[name] = [p for _, p in box]
    if rank != 0:
        return None
    rows = {}
    for name, (walls, traces) in got.items():
        sched = schedules[name].model_copy(update={"profile": pooled[mode_of[name]]})
        tl = timeline(sched)
        spans = [t.makespan_ms() for t in traces]
        peaks = [max(e.args.activations for e in r) for r in traces[-1].rank_events()]
        rows[name] = {"makespan_ms": statistics.median(spans), "wall_ms": statistics.median(walls),
                      "predicted_ms": tl.makespan, "measured_over_predicted": statistics.median(spans) / tl.makespan,
                      "peak_bytes": peaks, "meter_peak_bytes": meter_peaks[name],
                      "predicted_peak_bytes": list(tl.peak_memory), "selective": mode_of[name],
                      "limit_bytes": schedules[name].memory_limit, "gradients_exact": exact[name],
                      "recomputed": sum(a.op in (Op.R, Op.RS) for row in sched.rank_actions for a in row),
                      "rs": sum(a.op is Op.RS for row in sched.rank_actions for a in row),
                      "passes": [{"rank": x.rank, "op": x.op.value, "count": x.count, "measured_ms": x.measured_ms,
                                  "predicted_ms": x.predicted_ms} for x in compare_pass_times(sched, traces)],
                      "waits": [vars(w) for w in measure_idle_time(sched, traces)]}
    return {"config": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "seq": cfg.seq,
                       "microbatch": cfg.microbatch_size, "m": m, "steps": args.real_steps * args.real_rounds},
            "loads": loads, "rows": rows,
            "profiles": {mode: pooled[mode].model_dump(mode="json", exclude={"measured"}) for mode in modes}}


def real_part(args) -> dict:
    from bench.pipeline import launch

    res = launch(_real_worker, 2, args)
    for name, r in res["rows"].items():
        print(f"real {name:<30} measured {r['makespan_ms']:.2f} ms predicted {r['predicted_ms']:.2f} ms "
              f"(x{r['measured_over_predicted']:.3f}); peak bytes after a pass {r['peak_bytes']}, inside "
              f"{r['meter_peak_bytes']}, predicted {[round(x) for x in r['predicted_peak_bytes']]}; gradients exact "
              f"{r['gradients_exact']}; {r['recomputed']} recomputed ({r['rs']} RS, {r['selective']})", flush=True)
    return res


def _oracle_instance(seed: int):
    rng = random.Random(seed)
    chunks = 1 if seed % 3 else 2
    p = rng.choice([2, 3]) if chunks == 1 else 2
    m = rng.choice([2, 3]) if chunks == 1 else rng.choice([1, 2])
    inst = with_recompute(rng, random_instance(rng, FAMILIES[seed % 3], p, m, chunks, "none"), selective=seed % 2 == 0)
    low = smallest_feasible_limit(inst.cost, m, "auto")
    high = smallest_feasible_limit(inst.cost, m)
    x = rng.choice([0.0, 0.1, 0.3, 0.6, 1.0])
    return inst, [lo + x * (1.5 * hi - lo) for lo, hi in zip(low, high)], x


def oracle_part(args) -> dict:
    cases = [_oracle_instance(args.seed + k) for k in range(args.count)]
    jobs = [(inst.cost, inst.m, limit, obj, {"recompute": True}) for inst, limit, _ in cases for obj in ("span", "makespan")]
    t0 = time.monotonic()
    opts = cp_optimum_many(jobs, time_limit=args.oracle_time, processes=args.processes)
    oracle_s = time.monotonic() - t0
    rows = []
    for k, (inst, limit, x) in enumerate(cases):
        for j, obj in enumerate(("span", "makespan")):
            opt = opts[2 * k + j]
            fn = memory_span_lower_bound if obj == "span" else memory_makespan_lower_bound
            bound = fn(inst.cost, inst.m, limit)
            res = solve(inst.profile, inst.m, limit, chunks=inst.chunks, objective=obj, recompute="auto",
                        time_limit=args.oracle_solve_time)
            recomputes = sum(a.op.value.startswith("R") for r in opt.rows for a in r)
            rows.append({"family": inst.family, "p": inst.profile.num_ranks, "chunks": inst.chunks, "m": inst.m,
                         "x": x, "objective": obj, "optimum": opt.value, "proven": opt.optimal,
                         "optimum_recomputes": recomputes, "bound": bound,
                         "unsound": opt.optimal and bound > opt.value * (1 + TOL),
                         "solve_value": res.info.value, "solve_bound": res.info.lower_bound, "status": res.info.status,
                         "solve_unsound": opt.optimal and res.info.lower_bound > opt.value * (1 + TOL),
                         "below_optimum": res.info.value < opt.value * (1 - TOL) and opt.optimal,
                         "false_optimal": opt.optimal and res.info.status == "optimal" and res.info.value > opt.value * (1 + TOL),
                         "gap_to_optimum": res.info.value / opt.value - 1})
    proven = [r for r in rows if r["proven"]]
    summary = {"n": len(rows), "proven": len(proven), "optimum_recomputes": sum(r["optimum_recomputes"] > 0 for r in proven),
               "unsound_bound": sum(r["unsound"] for r in rows), "unsound_solve_bound": sum(r["solve_unsound"] for r in rows),
               "below_optimum": sum(r["below_optimum"] for r in rows), "false_optimal": sum(r["false_optimal"] for r in rows),
               "optimal_claims": sum(r["status"] == "optimal" for r in rows),
               "at_optimum": sum(r["gap_to_optimum"] <= TOL for r in proven),
               "max_gap_to_optimum": max((r["gap_to_optimum"] for r in proven), default=0.0),
               "mean_bound_share": sum(r["bound"] / r["optimum"] for r in proven) / max(1, len(proven)),
               "oracle_s": oracle_s}
    print(f"oracle: {summary}")
    return {"summary": summary, "cases": rows}


def frontier_part(args) -> dict:
    prof = load_profile("1.5b-m24")
    out = []
    for chunks in (1, 2):
        for mode in ("none", "auto"):
            fr = frontier(prof, 24, chunks=chunks, recompute=mode, time_limit=args.frontier_time)
            pts = [{"limit": pt.limit, "bubble": pt.bubble_rate, "bound_bubble": pt.bound_bubble_rate, "gap": pt.gap,
                    "status": pt.status, "recomputed": pt.recomputed} for pt in fr.points]
            out.append({"chunks": chunks, "mode": mode, "unlimited": fr.unlimited_bubble_rate, "points": pts})
            print(f"frontier v={chunks} {mode}: " + ", ".join(f"{p['limit']:.3g}p {p['bubble']:.4f}" for p in pts), flush=True)
    return {"runs": out}


_PARTS = {"controllable": controllable_part, "recompute": recompute_part, "scale": scale_part, "oracle": oracle_part,
          "frontier": frontier_part, "real": real_part}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(_PARTS))
    ap.add_argument("--time-limit", type=float, default=30.0, help="solve time limit, controllable and recompute parts")
    ap.add_argument("--count", type=int, default=40, help="oracle instances")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--oracle-time", type=float, default=30.0, help="CP-SAT deterministic time per instance")
    ap.add_argument("--oracle-solve-time", type=float, default=5.0)
    ap.add_argument("--frontier-time", type=float, default=60.0)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--real-layers", type=int, default=4)
    ap.add_argument("--real-hidden", type=int, default=64)
    ap.add_argument("--real-heads", type=int, default=4)
    ap.add_argument("--real-seq", type=int, default=256)
    ap.add_argument("--real-batch", type=int, default=4)
    ap.add_argument("--real-m", type=int, default=8)
    ap.add_argument("--real-steps", type=int, default=8, help="timed steps per schedule and round")
    ap.add_argument("--real-rounds", type=int, default=2)
    ap.add_argument("--real-repeat", type=int, default=8, help="profiler repetitions per pass")
    ap.add_argument("--real-solve-time", type=float, default=10.0)
    ap.add_argument("-o", "--output", default="recompute")
    args = ap.parse_args()
    doc: dict = {"settings": {k: v for k, v in vars(args).items() if k != "output"}}
    for part in args.parts.split(","):
        doc[part] = _PARTS[part](args)
    save(doc, args.output)


if __name__ == "__main__":
    main()
