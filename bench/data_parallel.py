"""Data parallelism around the pipeline: the iteration each schedule is predicted to take with its
gradient reductions, against what it takes with real reductions.

PP x DP on local gloo processes, PP = 2, 3 and 4 (one launch each), DP = 2. The passes are
emulated (``EmulatedStage``: each sleeps its profile time, so ranks do not compete for cores),
the reductions are real: every rank holds ``--grad-mb`` MiB of gradients (split between its
stages, so every placement reduces the same bytes per rank), reduced across the replicas with
gloo. A sleep is not slowed by a reduction beside it as a real pass is: the emulated device
slows its passes by ``--slowdown`` while one of its process's reductions is in flight (the
emulation's ``reduce_slowdown``; 1: never), for as long as the real reduction runs.

Per launch:
  0. profile the emulated stages as ``zbsearch profile`` profiles a stage, every rank at once (they
     sleep, so they do not compete for cores): each pass's repetitions (``measure_stage``: the
     runtime's pass functions, autograd and the split's bookkeeping included), then the same
     passes inside the runtime's steps (``in_step``), each pass costing its repetitions' mean
     scaled by its median in the steps; and, from those steps' traces, the runtime's host time
     between actions (``t_action``). The schedules are solved and predicted on these measured
     times; the stages still sleep the given ``--times``;
  1. profile the reductions: each stage's reduction of its gradients on the real data-parallel
     group (the runtime's buckets), every rank at once, for one stage per rank and for the V's
     pieces; the profile's ``t_reduce`` is the median, the slower replica's; and, as ``zbsearch
     profile --dp`` does (``zbsearch.profiler.slowdown``), each stage's emulated pass timed
     alone and beside its reduction: the profile's ``reduce_slowdown`` is the median factor
     over both replicas (what the emulated slowdown, the runtime's own work and the
     contention for the cores add up to);
  2. schedules on that profile: 1F1B, ZB-H1, ZB-2p (the span-optimal solve at 2p, one stage per
     rank), the iteration-aware solve (``--objective iteration``, started from ZB-2p), and the
     same two on the V;
  3. each schedule replayed round robin after warm-up, barrier to barrier
     (``zbsearch.app.demo.mesh_replay``, what ``zbsearch demo --dp`` runs), three ways:
       overlapped  the runtime with the mesh: a stage's reduction starts at its last W (or BW)
                   of the step and the runtime waits for it at the end of the step
       after       the runtime on the pipeline group only, then the same reductions (same
                   buckets) started and waited for after ``step()``
       none        the runtime on the pipeline group only, no reduction: the passes alone
Predictions, from the profile, of the iteration barrier to barrier:
  simulated   the simulator's timeline with its reduction lane (``zbsearch.reductions``): the
              last rank's last reduction (overlapped), or each rank's last pass then all its
              reductions (after); what ``zbsearch simulate`` predicts
  given       the same from the given pass times, with no host time per action: what the
              profile held before its passes were measured
  on passes   the measured passes alone (``none``) plus what the reductions add to the
              simulated timeline: this takes out the runtime's own time per pass (messages,
              waking from sleep), which the emulated profile does not hold
and, from the runtime's trace of the last overlapped step, each reduction's time in the step
against the profile's (``zbsearch.reduction_times``, what ``simulate --measured`` compares; its
end as gloo completed it); and, from every rank's reductions in every overlapped round, how far
apart the replicas reach each one (``replica_drift``: the simulator has them in step, while a
collective completes only once the later replica has joined it).
Target: measured iteration within 5% of the prediction for every schedule.

Saves bench/results/data_parallel.json.
Run: PYTHONPATH=. python bench/data_parallel.py [--pp 2 3 4] [--dp 2] [-m 8] [--grad-mb 24] [--iters 10] [--slowdown F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import save
from pipeline import launch

import zbsearch as zb
from zbsearch.formats.trace import Trace
from zbsearch.reduction_times import compare_reductions

UNIT = 2**16  # bytes of emulated activations per M_B
SOLVE_S = 6.0  # seconds per solve


def profile(pp: int, times: list[float], chunks: int, t_reduce: list[float] | None = None,
            slowdown: list[float] | None = None, sharing=None, dp: int = 2, measured: dict | None = None,
            stretch: list[float] | None = None) -> zb.Profile:
    """Equal emulated stages (ms), no link time (local processes): one per rank, or the V's
    pieces (half a stage each, measured for the V placement); ``t_reduce``, ``slowdown``
    (``reduce_slowdown``) and ``stretch`` (``reduce_stretch``) per stage or piece; ``sharing``
    (``LaneSharing``), how the ranks' reductions slow each other on this host; ``measured``: the pass times measured per stage or
    piece (``stages``: t_f, t_b, t_w, t_bw, t_ff each) and the runtime's host time per action
    (``t_action``), which replace the given times (None: the given times, no host time)."""
    from zbsearch.layout import placement

    t_f, t_b, t_w = (t / chunks for t in times)
    st = zb.StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0 / chunks, m_b=-0.6 / chunks, m_w=-0.4 / chunks)
    stages = [st if measured is None else st.model_copy(update=measured["stages"][s]) for s in range(pp * chunks)]
    if t_reduce is not None:
        stages = [c.model_copy(update={"t_reduce": t_reduce[s], "t_opt": 0.0}) for s, c in enumerate(stages)]
    if slowdown is not None:
        stages = [c.model_copy(update={"reduce_slowdown": f if f > 1.0 else None}) for c, f in zip(stages, slowdown)]
    if stretch is not None:
        stages = [c.model_copy(update={"reduce_stretch": f if f > 1.0 else None}) for c, f in zip(stages, stretch)]
    extra = {}
    if sharing is not None:
        from zbsearch.formats.profile import DataParallel

        extra["data_parallel"] = DataParallel(replicas=dp, how="measured", group="local", backend="gloo", sharing=sharing)
    if measured is not None:
        extra["t_action"] = measured["t_action"]
    return zb.Profile(name=f"emulated-p{pp}" + ("-v" if chunks == 2 else ""), memory_unit="activations", stages=stages,
                      placement=placement(pp, 2, "v") if chunks == 2 else None, **extra)


def schedules(one: zb.Profile, v: zb.Profile, m: int) -> list[zb.Schedule]:
    """The schedules compared, named by kind."""
    from zbsearch.solver import solve

    out = [zb.build_classic(k, one, m) for k in ("1f1b", "zb-h1")]
    span = solve(one, m, "2p", objective="span", time_limit=SOLVE_S).schedule
    out.append(span.model_copy(update={"kind": "zb-2p"}))
    it = solve(one, m, "2p", objective="iteration", time_limit=SOLVE_S, start=span.rank_actions).schedule
    out.append(it.model_copy(update={"kind": "iteration-2p"}))
    span_v = solve(v, m, "2p", chunks=2, objective="span", time_limit=SOLVE_S).schedule
    out.append(span_v.model_copy(update={"kind": "zb-2p-v"}))
    it_v = solve(v, m, "2p", chunks=2, objective="iteration", time_limit=SOLVE_S, start=span_v.rank_actions).schedule
    out.append(it_v.model_copy(update={"kind": "iteration-2p-v"}))
    return out


def predict(sched: zb.Schedule) -> dict:
    """The iteration barrier to barrier (ms) the simulator predicts from ``sched``'s profile:
    the passes, and with the reductions overlapped (its reduction lane) or after the step."""
    from dataclasses import replace

    from zbsearch.costs import CostModel
    from zbsearch.reductions import last_backward, shared_lane_runs
    from zbsearch.simulator import simulate

    cost = CostModel.from_profile(sched.profile, sched.stage_to_rank)
    tl = simulate(sched.rank_actions, cost)
    passes = max(max(e) for e in tl.end)
    # after the step: each rank's reductions from its last pass, the ranks' lanes sharing the host
    ready = [[(max(e), cost.t_reduce[s]) for s in last_backward(row)] for row, e in zip(tl.actions, tl.end)]
    lanes = shared_lane_runs(ready, cost.lane_link or range(cost.num_ranks), cost.lane_share)
    after = max(max([max(e), *(b for _, b in runs)]) for e, runs in zip(tl.end, lanes))
    tails = {s: max(e) - e[i] for row, e in zip(tl.actions, tl.end) for s, i in last_backward(row).items()}
    full_speed = simulate(sched.rank_actions, cost.without_slowdown())  # the reductions slowing no pass, nor each other
    alone = simulate(sched.rank_actions, replace(cost, lane_link=(), lane_share=0.0))  # each lane alone on its link
    return {"passes_ms": passes, "overlapped_ms": max(tl.finish), "after_ms": after, "tail_ms": tails,
            "overlapped_full_speed_ms": max(full_speed.finish), "overlapped_no_sharing_ms": max(alone.finish)}


PASSES = ("t_f", "t_b", "t_w", "t_bw", "t_ff")


def _measure_passes(stages: dict, owner: list[int], pp_group, reps: int):
    """This rank's emulated stages measured as ``zbsearch profile`` measures a stage, the ranks of
    the pipeline at once: each pass's repetitions, then the pipeline's calibration steps
    (``in_step``). Returns this rank's {stage: StageMeasurement} and, on the pipeline's rank 0,
    the steps' traces (None elsewhere)."""
    import torch

    from zbsearch.profiler.in_step import calibration_orders, calibration_steps, run_in_steps
    from zbsearch.profiler.measure import measure_stage
    from zbsearch.runtime import emulated_loss

    last = len(owner) - 1
    x, target = torch.zeros(1, 16), torch.zeros(1, 16)
    got = {}
    for s, module in stages.items():
        post = (lambda out: emulated_loss(out, target)) if s == last else None
        got[s] = measure_stage(module, (x.clone().requires_grad_(s > 0),), post, torch.device("cpu"), 3, reps)
    orders = calibration_orders(owner)
    assert orders is not None  # one stage per rank, or the V
    traces = run_in_steps(orders, stages, (x,) if 0 in stages else (), emulated_loss, target,
                          calibration_steps(reps, orders), group=pp_group, device=torch.device("cpu"), timeout=300.0,
                          keep_heap=False)
    return got, traces


def _measured(parts: list, P: int) -> dict:
    """The measured profile's times from every rank's (replica, ``_measure_passes``): per stage,
    each replica's measurement costed as ``zbsearch profile`` costs it (``StageMeasurement.cost``,
    with the in-step times of that replica's steps), the replicas' mean; ``t_action``: the mean
    host time between actions over every replica's steps (``in_step.action_host_times``)."""
    import dataclasses

    from zbsearch.profiler.in_step import action_host_times, in_step_times

    steps = {replica: in_step_times(traces, P) for replica, _, traces in parts if traces is not None}
    gaps = [g for _, _, traces in parts if traces is not None
            for g in action_host_times([t for way in traces.values() for t in way])]
    out = []
    for s in range(P):
        costs = [dataclasses.replace(got[s], in_step=steps[replica][s] or None).cost()
                 for replica, got, _ in parts if s in got]
        out.append({key: statistics.fmean(getattr(c, key) for c in costs) for key in PASSES})
    return {"stages": out, "t_action": statistics.fmean(gaps)}


def _reductions_alone_and_together(stages: dict, dp_group, me: int, pp: int, reps: int) -> dict[int, tuple[list, list]]:
    """Each of this rank's stages' reductions (the runtime's buckets) timed alone, the other
    pipeline ranks waiting, and with every rank reducing its k-th stage at once (ms), as
    ``zbsearch profile --dp`` times them (``sharing_samples``)."""
    from zbsearch.profiler.gradients import sharing_samples

    alone, together = sharing_samples(list(stages.values()), dp_group, me, pp, reps, 300.0)
    return {s: (a, t) for s, a, t in zip(stages, alone, together)}


def _slowdown_alone(stages: dict, dp_group, reps: int) -> dict:
    """Each of this rank's stages' pass timed beside its reduction against alone, and the
    reduction beside the pass against alone (``Factors``), as ``zbsearch profile --dp`` times
    them, every rank its k-th stage at once."""
    import torch

    from zbsearch.profiler.slowdown import reduction_buffers, slowdown_samples, stage_pass

    x = torch.zeros(16, requires_grad=True)
    got = slowdown_samples([stage_pass(m, (x,)) for m in stages.values()],
                           [reduction_buffers(m, dp_group, 300.0) for m in stages.values()], dp_group, reps, 1, 300.0)
    return dict(zip(stages, got))


def worker(rank, world, send, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist

    from zbsearch.app.demo import mesh_replay
    from zbsearch.distributed.mesh import build_mesh
    from zbsearch.profiler.gradients import lane_sharing
    from zbsearch.runtime import emulated_loss, emulated_stages

    pp = cfg["pp"]
    mesh = build_mesh(pp=pp, dp_replicate=cfg["dp"])
    me = mesh["pp"].get_local_rank()
    dp_group = mesh["dp_replicate"].get_group()

    def mine(stage_to_rank: list[int]) -> dict:
        """This rank's emulated stages, sleeping the given times, slowed as the emulated device is (``--slowdown``)."""
        chunks = len(stage_to_rank) // pp
        prof = profile(pp, cfg["times"], chunks)
        device = [cfg["slowdown"]] * prof.num_stages
        emulated = prof.model_copy(update={"stages": [c.model_copy(update={"reduce_slowdown": f if f > 1.0 else None})
                                                      for c, f in zip(prof.stages, device)]})
        stages = emulated_stages(emulated, stage_to_rank, bytes_per_unit=UNIT, grad_bytes=cfg["grad_mb"] * 2**20 / chunks)
        return {s: stages[s] for s in range(len(stage_to_rank)) if stage_to_rank[s] == me}

    # 0. the passes' profile, each replica's pipeline at once; 1. the reductions' profile, on the
    # data-parallel groups: their times, then how much they slow the passes
    alone, slowed, passes = {}, {}, {}
    replica = mesh["dp_replicate"].get_local_rank()
    for chunks in (1, 2):
        owner = profile(pp, cfg["times"], chunks).placement or list(range(pp))
        stages = mine(owner)
        passes[chunks] = (replica, *_measure_passes(stages, owner, mesh["pp"].get_group(), cfg["pass_reps"]))
        alone[chunks] = _reductions_alone_and_together(stages, dp_group, me, pp, cfg["profile_reps"])
        slowed[chunks] = _slowdown_alone(stages, dp_group, cfg["profile_reps"])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (alone, slowed, passes))
    # 2. the schedules, solved on rank 0
    box: list = [None]
    if rank == 0:
        profs = {}
        for chunks in (1, 2):
            P = pp * chunks
            timed = [[part[0][chunks][s] for part in everyone if s in part[0][chunks]] for s in range(P)]
            t_reduce = [max(statistics.median(a) for a, _ in got) for got in timed]  # the slower replica's
            factors, stretch = ([max(1.0, statistics.median([f for part in everyone if s in part[1][chunks]
                                                             for f in getattr(part[1][chunks][s], kind)] or [1.0]))
                                 for s in range(P)] for kind in ("passes", "lane"))
            sharing = lane_sharing([[x for a, _ in got for x in a] for got in timed],
                                   [[x for _, t in got for x in t] for got in timed], [pp] * P, None)
            measured = _measured([part[2][chunks] for part in everyone], P)
            profs[chunks] = profile(pp, cfg["times"], chunks, t_reduce, factors, sharing, cfg["dp"], measured, stretch)
        box[0] = [s.model_dump_json() for s in schedules(profs[1], profs[2], cfg["m"])]
    dist.broadcast_object_list(box, src=0)
    scheds = [zb.Schedule.model_validate_json(s) for s in box[0]]

    def batch(sched: zb.Schedule):
        return torch.zeros(cfg["m"], 16), torch.zeros(cfg["m"], 16), emulated_loss

    # 3. the replays
    got = mesh_replay(mesh, scheds, lambda s: mine(s.stage_to_rank), batch, cfg["iters"], warmup=cfg["warmup"])
    after_runs: list = [None] * world
    dist.all_gather_object(after_runs, ({k: v["reduction_stage_ms"] for k, v in got.items()},
                                        (replica, me, {k: v["overlapped_reductions_ms"] for k, v in got.items()})))
    if rank != 0:
        return None
    out = {}
    for sched in scheds:
        later: dict[int, float] = {}
        for part, _ in after_runs:
            for s, v in part[sched.kind].items():
                later[int(s)] = max(later.get(int(s), 0.0), v)
        g = got[sched.kind]
        out[sched.kind] = {"schedule": sched.model_dump_json(), "reduction_alone_after_ms": later,
                           "overlapped_ms": g["overlapped_runs_ms"], "after_ms": g["after_runs_ms"],
                           "none_ms": g["none_runs_ms"], "trace": g["trace"],
                           "replica_lanes": {f"{rep} {r}": lanes[sched.kind] for _, (rep, r, lanes) in after_runs}}
    return out


def replica_drift(lanes: dict[str, list]) -> dict:
    """How far apart the replicas reach each reduction, from every rank's overlapped rounds
    (``lanes``: "replica rank" -> per round, its (stage, start, end) in ms from the round's
    barrier): per round, pipeline rank and stage, the spread of the replicas' starts (median,
    largest), and the part of the reductions' time (start to end, summed over the replicas)
    that a replica spent waiting for the later one to start (a collective completes only once
    every replica has joined it)."""
    by: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    for key, rounds in lanes.items():
        r = int(key.split()[1])
        for i, runs in enumerate(rounds):
            for s, start, end in runs:
                by.setdefault((i, r, int(s)), []).append((start, end))
    spread = [max(a for a, _ in xs) - min(a for a, _ in xs) for xs in by.values()]
    waited = sum(max(a for a, _ in xs) - a for xs in by.values() for a, _ in xs)
    took = sum(b - a for xs in by.values() for a, b in xs)
    return {"replica_skew_ms": statistics.median(spread) if spread else 0.0, "replica_skew_max_ms": max(spread, default=0.0),
            "later_replica_wait_share": waited / took if took > 0 else 0.0}


def run(pp: int, args) -> dict:
    cfg = {"pp": pp, "dp": args.dp, "m": args.m, "grad_mb": args.grad_mb, "times": args.times, "iters": args.iters,
           "warmup": args.warmup, "profile_reps": args.profile_reps, "slowdown": args.slowdown,
           "pass_reps": args.pass_reps}
    load = os.getloadavg()
    t0 = time.perf_counter()
    res = launch(worker, pp * args.dp, cfg)
    rows = {}
    print(f"PP{pp} x DP{args.dp}, m={args.m}, {args.grad_mb:g} MiB of gradients per rank, passes {args.times} ms")
    print(f"{'schedule':15} {'reduce':>6} {'given':>7} {'sim pass':>8} {'passes':>7} {'sim over':>8} {'on pass':>8} "
          f"{'overlap':>8} {'err sim':>7} {'err pass':>8} {'after':>7} {'err':>6} {'skew':>5} {'waited':>6}")
    for kind, doc in res.items():
        sched = zb.Schedule.model_validate_json(doc["schedule"])
        cost = zb.CostModel.from_profile(sched.profile, sched.stage_to_rank)
        pred = predict(sched)
        given = profile(pp, args.times, sched.num_stages // pp)  # the times the stages sleep, no host time
        given_prof = sched.profile.model_copy(update={"t_action": None, "stages": [
            c.model_copy(update={"t_f": g.t_f, "t_b": g.t_b, "t_w": g.t_w, "t_bw": None, "t_ff": None})
            for c, g in zip(sched.profile.stages, given.stages)]})
        pred_given = predict(sched.model_copy(update={"profile": given_prof}))
        over, after = statistics.median(doc["overlapped_ms"]), statistics.median(doc["after_ms"])
        none = statistics.median(doc["none_ms"])
        on_passes_over = none + pred["overlapped_ms"] - pred["passes_ms"]
        on_passes_after = none + pred["after_ms"] - pred["passes_ms"]
        per_rank = max(sum(cost.t_reduce[s] for s in cost.rank_stages(r)) for r in range(cost.num_ranks))
        # the last overlapped step's reductions on replica 0 (its trace), against the profile
        in_step = compare_reductions(sched, [Trace.model_validate_json(doc["trace"])])
        row = {
            "reduction_per_rank_ms": per_rank, "t_reduce_ms": list(cost.t_reduce),
            "reduction_alone_after_ms": doc["reduction_alone_after_ms"], "tail_after_last_w_ms": pred["tail_ms"],
            "simulated_passes_ms": pred["passes_ms"], "simulated_overlapped_ms": pred["overlapped_ms"],
            "t_action_ms": sched.profile.t_action or 0.0,
            "measured_pass_ms": {k: statistics.fmean(getattr(c, k) for c in sched.profile.stages) for k in PASSES},
            "given_passes_ms": pred_given["passes_ms"], "given_overlapped_ms": pred_given["overlapped_ms"],
            "overlapped_vs_given": over / pred_given["overlapped_ms"] - 1,
            "simulated_after_ms": pred["after_ms"], "simulated_iteration_ms": max(sched.predicted.iteration),
            "slowdown": [c.reduce_slowdown or 1.0 for c in sched.profile.stages],
            "stretch": [c.reduce_stretch or 1.0 for c in sched.profile.stages],
            "simulated_overlapped_full_speed_ms": pred["overlapped_full_speed_ms"],
            "share": cost.lane_share,
            "on_passes_overlapped_no_sharing_ms": none + pred["overlapped_no_sharing_ms"] - pred["passes_ms"],
            "overlapped_vs_on_passes_no_sharing": over / (none + pred["overlapped_no_sharing_ms"] - pred["passes_ms"]) - 1,
            "on_passes_overlapped_full_speed_ms": none + pred["overlapped_full_speed_ms"] - pred["passes_ms"],
            "overlapped_vs_on_passes_full_speed": over / (none + pred["overlapped_full_speed_ms"] - pred["passes_ms"]) - 1,
            "on_passes_overlapped_ms": on_passes_over, "on_passes_after_ms": on_passes_after,
            "measured_passes_ms": none, "measured_overlapped_ms": over, "measured_after_ms": after,
            "overlapped_runs_ms": doc["overlapped_ms"], "after_runs_ms": doc["after_ms"], "none_runs_ms": doc["none_ms"],
            "passes_vs_simulated": none / pred["passes_ms"] - 1,
            "overlapped_vs_simulated": over / pred["overlapped_ms"] - 1,
            "overlapped_vs_on_passes": over / on_passes_over - 1,
            "after_vs_simulated": after / pred["after_ms"] - 1,
            "after_vs_on_passes": after / on_passes_after - 1,
            "in_step": [{"rank": x.rank, "stage": x.stage, "measured_ms": x.measured_ms, "predicted_ms": x.predicted_ms,
                         "measured_delay_ms": x.measured_delay_ms, "predicted_delay_ms": x.predicted_delay_ms}
                        for x in in_step],
            "in_step_vs_profiled": statistics.fmean(x.measured_ms / x.predicted_ms for x in in_step) - 1,
            **replica_drift(doc["replica_lanes"]),
        }
        rows[kind] = row
        print(f"{kind:15} {per_rank:6.1f} {pred_given['overlapped_ms']:7.1f} {pred['passes_ms']:8.1f} {none:7.1f} "
              f"{pred['overlapped_ms']:8.1f} "
              f"{on_passes_over:8.1f} {over:8.1f} {row['overlapped_vs_simulated']:+7.1%} "
              f"{row['overlapped_vs_on_passes']:+8.1%} {after:7.1f} {row['after_vs_on_passes']:+6.1%} "
              f"{row['replica_skew_ms']:5.1f} {row['later_replica_wait_share']:6.1%}", flush=True)
    return {"pp": pp, "world": pp * args.dp, "schedules": rows, "load_average_before": load,
            "load_average_after": os.getloadavg(), "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--grad-mb", type=float, default=24.0, help="MiB of gradients per rank (all its stages)")
    ap.add_argument("--times", type=float, nargs=3, default=[20.0, 20.0, 15.0], metavar=("T_F", "T_B", "T_W"),
                    help="emulated pass times of one stage per rank, ms")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-reps", type=int, default=5, help="timed reductions per stage for the profile")
    ap.add_argument("--pass-reps", type=int, default=10, help="timed repetitions per pass for the passes' profile")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="how much slower the emulated passes run while a reduction of their process is in flight")
    ap.add_argument("-o", "--output", default="data_parallel")
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = [run(pp, args) for pp in args.pp]
    save({"pp": args.pp, "dp": args.dp, "m": args.m, "grad_mb": args.grad_mb, "times_ms": args.times,
          "iters": args.iters, "warmup": args.warmup, "profile_reps": args.profile_reps, "solve_s": SOLVE_S,
          "pass_reps": args.pass_reps,
          "slowdown": args.slowdown, "reduction_end": "completed",
          "runs": runs, "wall_s": time.perf_counter() - t0}, args.output)


if __name__ == "__main__":
    main()
