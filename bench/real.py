"""Real passes: do the predictions hold when the stages really compute?

One launch, p=2 ranks (one process each, one torch thread each), a small GPT on CPU:
  1. profile with the profiler, in the layout the schedules run in (``profile_distributed``: the
     ranks measure at once, as they compute in the runtime): the model cut into 2 stages (one per rank), and cut into the 4
     pieces of a V (``placement`` [0, 1, 1, 0]: rank 0 holds the first and the last piece,
     each rank measures its own two), fused backward (t_bw) included;
  2. build the schedules: 1F1B, ZB-H1, ZB-2p (the solver) on the 2-stage profile, ZB-V on the
     V pieces' own profile; torch's Schedule1F1B and ScheduleInterleavedZeroBubble on the same
     two stages, and torch's ScheduleZBVZeroBubble on the same V pieces;
  3. run them round-robin, one step each per round, after warm-up rounds, so that load from
     elsewhere falls on all of them alike; the load average is read after every round;
  4. profile again after every round of steps (one profiler round each time) and predict from
     the rounds pooled (``zbsearch.pooling``): this VM's speed drifts (a stage's 10-repetition
     median moved 12.6-17.2 ms within one quiet minute), so a profile taken in one moment and
     steps taken in others would compare two machines; interleaved, the drift falls on both.
     The schedules are built on the first round alone, and what that one round predicts (a
     one-shot profile) is reported beside the pooled prediction, and so is what the profiler's
     repetitions alone predict ("reps only": each pass at its repetitions' mean rather than at
     its time in the profiler's own steps, ``zbsearch.profiler.in_step``).
torch's schedules are predicted too: the order their stages ran (recorded from the stages' own
forward / backward calls, not from torch's ``pipeline_order``, which for Schedule1F1B is only
for display and differs from what it runs), simulated on the same profile. The profile times
zbsearch's passes, so torch's split backward, which costs its own, is predicted at ours.

Reported per schedule: median and quartiles of the step's wall time (barrier to barrier) and of
the makespan in the runtime's trace, the prediction (and, for ours, the prediction without the
profile's host time per message, ``t_send`` / ``t_recv``), measured / predicted, per-pass times
against the profile, where each rank's idle time went (``zbsearch.idle_time``: dependency, link,
local), each ZB schedule's speed-up over 1F1B measured against predicted, and the
verdict on each of the targets (``real_targets``), with the load average of every round:
a load above the core count marks the run as busy, and then its verdicts settle nothing.

Run (the quiet-machine run of the README): python bench/real.py
  defaults: GPT hidden 256, 4 layers, seq 64, microbatch 4, m=8, 30 timed steps per schedule in
  5 rounds, 3 warm-up steps; estimated 2-2.5 minutes on 2 quiet cores (297 s at load 7-9).
Quick check that it works: python bench/real.py --steps 3 --rounds 1 --warmup 1 --repeat 3 -o /tmp/real.json
Saves bench/results/real.json (or -o).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from common import RESULTS, save
from pipeline import launch, ours, round_robin
from real_targets import Result, Spread, report_lines, verdicts

import zbsearch as zb
from zbsearch.formats.profile import MIN_TIME_MS
from zbsearch.layout import placement
from zbsearch.pooling import pool_profiles

V = placement(2, 2, "v")  # piece -> rank: [0, 1, 1, 0]
TORCH = {  # torch's schedule -> whether it runs on the V pieces
    "Schedule1F1B": False, "ScheduleInterleavedZeroBubble": False, "ScheduleZBVZeroBubble": True,
}


def _quartiles(xs: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": min(xs)}


def _torch_runner(rank, kind, stages, stage_to_rank, m, inputs, targets, loss):
    """A step of torch's schedule ``kind`` on this rank's stages; its trace is the order the
    stages ran their passes in, in our notation (F, B = input gradient, W, BW = full backward)."""
    import torch
    from torch.distributed.pipelining import schedules

    n = len(stage_to_rank)
    mine = [s for s in range(n) if stage_to_rank[s] == rank]
    pipe = [schedules.PipelineStage(stages[s], s, n, torch.device("cpu")) for s in mine]
    ran: list[str] = []
    for st in pipe:
        _record(st, ran)
    cls = getattr(schedules, kind)
    sched = cls(pipe[0] if issubclass(cls, schedules.PipelineScheduleSingle) else pipe, m, loss_fn=loss)

    def step():
        ran.clear()
        for s in mine:
            stages[s].zero_grad(set_to_none=True)
        sched.step(*((inputs,) if 0 in mine else ()), target=targets if n - 1 in mine else None)

    return step, lambda: list(ran)


def _record(stage, ran: list[str]) -> None:
    """Log each pass the torch stage runs (``{stage}{op}{microbatch}``) into ``ran``."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    s = stage.stage_index

    def forward_one_chunk(mb, *a, **k):
        ran.append(f"{s}F{mb}")
        return fwd(mb, *a, **k)

    def backward_one_chunk(mb, *a, full_backward=True, **k):
        ran.append(f"{s}{'BW' if full_backward else 'B'}{mb}")
        return bwd(mb, *a, full_backward=full_backward, **k)

    def backward_weight_one_chunk(mb, *a, **k):
        ran.append(f"{s}W{mb}")
        return wgt(mb, *a, **k)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def worker(rank, world, send, args) -> dict | None:
    import torch
    import torch.distributed as dist

    from zbsearch.idle_time import measure_idle_time
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
    from zbsearch.pass_times import compare_pass_times
    from zbsearch.profiler import Settings, builtin_gpt, profile_distributed

    torch.set_num_threads(1)
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=max(2, args.hidden // 64), seq=args.seq,
                    vocab=args.vocab, microbatch_size=args.batch, stages=world)
    v_cfg = GPTConfig(**{**cfg.__dict__, "stages": 2 * world})
    settings = Settings(warmup=args.warmup, repeat=args.repeat, rounds=1, threads=1)
    profile_s = 0.0

    def profile_round() -> list[zb.Profile]:
        """One profiler round of the 2 stages and of the V pieces, on every rank."""
        nonlocal profile_s
        t0 = time.time()
        got = [profile_distributed(builtin_gpt(cfg), settings), profile_distributed(builtin_gpt(v_cfg), settings, placement=V)]
        box = [[p.model_dump_json() for p in got] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        profile_s += time.time() - t0
        return [zb.Profile.model_validate_json(p) for p in box[0]]

    taken = [profile_round()]  # profile rounds, one before each round of steps and one after the last
    prof, prof_v = taken[0]
    m = args.m
    schedules = {k: zb.build_classic(k, prof, m) for k in ("1f1b", "zb-h1")}
    if rank == 0:
        from zbsearch.solver import solve

        box = [solve(prof, m, "2p", time_limit=args.solve_time, objective="makespan").schedule.model_dump_json()]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    schedules["zb-2p"] = zb.Schedule.model_validate_json(box[0])
    schedules["zb-v"] = zb.build_classic("zb-v", prof_v, m)
    assert schedules["zb-v"].stage_to_rank == V
    inputs, targets = gpt_batch(cfg, m, seed=0)
    runners = {}
    for name, sched in schedules.items():
        stages = gpt_stages(v_cfg if sched.stage_to_rank == V else cfg)
        runners[f"ours {name}"] = ours(rank, sched, stages, inputs, targets, gpt_loss)
    for kind, on_v in TORCH.items():
        runners[f"torch {kind}"] = _torch_runner(rank, kind, gpt_stages(v_cfg if on_v else cfg),
                                                 V if on_v else list(range(world)), m, inputs, targets, gpt_loss)
    loads = []
    got = {name: ([], []) for name in runners}
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):  # warm-up is paid once; the load is read after every round
        part = round_robin(runners, per_round, args.warmup if not loads else 0)
        loads.append(os.getloadavg()[0])
        for name, (walls, traces) in part.items():
            got[name][0].extend(walls)
            got[name][1].extend(traces)
        taken.append(profile_round())
    pooled = {False: pool_profiles([t[0] for t in taken]), True: pool_profiles([t[1] for t in taken])}
    # what the profiler's repetitions alone predict (each pass at its repetitions' mean, not its
    # time in the profiler's steps): the same rounds, the same steps
    alone = {False: pool_profiles([_repetitions(t[0]) for t in taken]), True: pool_profiles([_repetitions(t[1]) for t in taken])}
    # the order each torch schedule ran, every rank's, on rank 0
    ran = {name: traces[-1] for name, (_, traces) in got.items() if name.startswith("torch")}
    assert all(t == traces[-1] for name, (_, traces) in got.items() if name in ran for t in traces), \
        "a torch schedule ran another order from one step to the next"
    orders = [None] * world if rank == 0 else None
    dist.gather_object(ran, orders, dst=0)
    if rank != 0:
        return None
    assert orders is not None
    for name in ran:
        on_v = TORCH[name.split(" ", 1)[1]]
        schedules[name] = zb.Schedule.build(  # on the first round, as ours: predicted below on both
            name, prof_v if on_v else prof, m, V if on_v else list(range(world)),
            [[zb.parse_action(a) for a in order[name]] for order in orders],
        )
        zb.validate(schedules[name])  # what torch ran is a complete schedule, dependencies kept
    rows = {}
    for name, (walls, traces) in got.items():
        key = name.split(" ", 1)[1] if name.startswith("ours") else name
        first = schedules[key]  # on the first profile round: what a one-shot profile predicts
        sched = first.model_copy(update={"profile": pooled[first.stage_to_rank == V]})
        tl = zb.timeline(sched)
        row = {"wall_ms": _quartiles(walls), "predicted_makespan_ms": tl.makespan,
               "predicted_first_round_ms": zb.timeline(first).makespan,
               "wall_over_predicted": statistics.median(walls) / tl.makespan, "load_per_round": loads}
        rep = first.model_copy(update={"profile": alone[first.stage_to_rank == V]})
        row["predicted_repetitions_ms"] = zb.timeline(rep).makespan
        if name.startswith("ours"):
            row["makespan_ms"] = _quartiles([t.makespan_ms() for t in traces])
            row["measured_over_predicted"] = row["makespan_ms"]["median"] / tl.makespan
            row["measured_over_repetitions"] = row["makespan_ms"]["median"] / row["predicted_repetitions_ms"]
            row["passes_repetitions"] = [
                {"rank": x.rank, "op": x.op.value, "measured_ms": x.measured_ms, "predicted_ms": x.predicted_ms, "ratio": x.ratio}
                for x in compare_pass_times(rep, traces)
            ]
            row["passes"] = [
                {"rank": x.rank, "op": x.op.value, "measured_ms": x.measured_ms, "predicted_ms": x.predicted_ms, "ratio": x.ratio}
                for x in compare_pass_times(sched, traces)
            ]
            row["waits"] = [vars(w) for w in measure_idle_time(sched, traces)]
            row["predicted_compute_only_ms"] = zb.simulate(sched.rank_actions, zb.CostModel.from_profile(
                sched.profile.compute_only(), sched.stage_to_rank)).makespan
        else:
            row["order"] = sched.actions
        rows[name] = row
    return {"profiles": [json.loads(p.model_dump_json()) for p in (pooled[False], pooled[True])], "profile_s": profile_s,
            "loads": loads, "rows": rows}


def _repetitions(p: zb.Profile) -> zb.Profile:
    """``p`` as the profiler's repetitions alone measured it: every pass the profiler also timed
    in steps (``zbsearch.profiler.in_step``) back at its repetitions' mean."""
    if p.measured is None or not any(st.in_step for st in p.measured.stages):
        return p
    assert all(c.t_r is None and c.t_rs is None for c in p.stages), "recompute passes are scaled by in-step times"
    stages = [c.model_copy(update={k: max(getattr(st, k).mean, MIN_TIME_MS) for k in (st.in_step or {})
                                   if getattr(st, k) is not None and getattr(st, k).mean is not None})
              for c, st in zip(p.stages, p.measured.stages)]
    return p.model_copy(update={"stages": stages})


def _spread(d: dict) -> Spread:
    return Spread(d["median"], d["q1"], d["q3"])


def _print_profile(title: str, doc: dict) -> None:
    print(f"{title} (ms): " + "; ".join(f"{s}: F {c['t_f']:.2f} B {c['t_b']:.2f} W {c['t_w']:.2f} BW {c['t_bw']:.2f} "
                                        f"FF {c['t_ff']:.2f}" for s, c in enumerate(doc["stages"]))
          + f"; links {', '.join(f'{t:.2f}' for t in doc['t_comm'])}"
          + (f"; host per message send {', '.join(f'{t:.2f}' for t in doc['t_send'])}, "
             f"recv {', '.join(f'{t:.2f}' for t in doc['t_recv'])}" if doc.get("t_send") else ""))
    rounds = doc["measured"].get("rounds")
    if rounds:
        worst = max((d, s, k) for s, row in enumerate(rounds["drift"]) for k, d in row.items())
        print(f"  {rounds['count']} profile rounds; largest drift between them {worst[0]:.1%} (stage {worst[1]} "
              f"{worst[2][2:].upper()}); times above are the rounds' medians")
    for w in doc["measured"]["warnings"]:
        print(f"  profiler warning: {w}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("-b", "--batch", type=int, default=4)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per schedule")
    ap.add_argument("--rounds", type=int, default=5,
                    help="the timed steps come in this many rounds, each followed by a profiler round (load read each)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule, and profiler warm-up repetitions")
    ap.add_argument("--repeat", type=int, default=10, help="profiler repetitions per pass")
    ap.add_argument("--solve-time", type=float, default=15.0)
    ap.add_argument("-o", "--output", type=Path, default=RESULTS / "real.json")
    args = ap.parse_args()
    if args.layers < 4 or args.layers % 4:
        ap.error("--layers must be a multiple of 4: the V cuts the model into 4 pieces, 2 of them per 2-stage stage")
    t0 = time.time()
    load_before = os.getloadavg()
    res = launch(worker, 2, args)
    cores = os.cpu_count() or 1
    rows, loads = res["rows"], res["loads"]
    print(f"p=2, GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, microbatch {args.batch}, m={args.m}, "
          f"{args.rounds * max(1, args.steps // args.rounds)} timed steps each; "
          f"{cores} cores, load average {load_before[0]:.1f} before, per round {', '.join(f'{x:.1f}' for x in loads)}")
    for title, r in rows.items():
        if "waits" in r:
            print(f"{title}: idle per step (ms; dependency / link / local) "
                  + "; ".join(f"rank {w['rank']}: {w['idle_ms']:.1f} ({w['dependency_ms']:.1f} / {w['link_ms']:.1f} / "
                              f"{w['local_ms']:.1f})" for w in r["waits"])
                  + f"; predicted without message host time {r['predicted_compute_only_ms']:.1f}")
    _print_profile("2 stages", res["profiles"][0])
    _print_profile("V pieces [0, 1, 1, 0]", res["profiles"][1])
    whole, pieces = res["profiles"][0]["stages"], res["profiles"][1]["stages"]
    # pieces 2s and 2s+1 are the layers of stage s: what the V pays for its finer cut, per pass
    print("V pieces / 2 stages (pieces 0+1 / stage 0; 2+3 / 1): " + "; ".join(
        f"{k[2:].upper()} " + ", ".join(f"{(pieces[2 * s][k] + pieces[2 * s + 1][k]) / whole[s][k]:.3f}" for s in range(2))
        for k in ("t_f", "t_b", "t_w", "t_bw", "t_ff")))
    print(f"{'schedule':36} {'wall ms (q1-q3)':>24} {'makespan ms':>12} {'predicted':>10} {'1st round':>10} "
          f"{'reps only':>10} {'meas/pred':>10}")
    for name, r in rows.items():
        w, mk = r["wall_ms"], r.get("makespan_ms")
        ratio = f"{r['measured_over_predicted']:10.3f}" if mk else f"{r['wall_over_predicted']:10.3f} (wall; info)"
        print(f"{name:36} {w['median']:8.1f} ({w['q1']:6.1f}-{w['q3']:6.1f}) {mk['median'] if mk else float('nan'):12.1f} "
              f"{r['predicted_makespan_ms']:10.1f} {r['predicted_first_round_ms']:10.1f} {r['predicted_repetitions_ms']:10.1f} "
              f"{ratio}" + (f" (reps only {r['measured_over_repetitions']:.3f})" if mk else ""))
    speedups = {}
    for side, base in (("ours", "ours 1f1b"), ("torch", "torch Schedule1F1B")):
        for name, r in rows.items():
            if not name.startswith(side) or name == base:
                continue
            b = rows[base]
            speedups[name] = {
                "predicted": b["predicted_makespan_ms"] / r["predicted_makespan_ms"],
                "measured_wall": b["wall_ms"]["median"] / r["wall_ms"]["median"],
                **({"measured_makespan": b["makespan_ms"]["median"] / r["makespan_ms"]["median"]} if side == "ours" else {}),
            }
            s = speedups[name]
            print(f"{name} / {base.split(' ', 1)[1]}: predicted {s['predicted']:.3f}x, measured {s['measured_wall']:.3f}x (wall)"
                  + (f", {s['measured_makespan']:.3f}x (makespan)" if "measured_makespan" in s else ""))
    results = {
        name: Result(_spread(r["wall_ms"]), r["predicted_makespan_ms"], _spread(r["makespan_ms"]) if "makespan_ms" in r else None)
        for name, r in rows.items()
    }
    ours_names = [n for n in rows if n.startswith("ours")]
    found = verdicts(results, ours_names, "ours 1f1b", "ours zb-2p", "torch ScheduleInterleavedZeroBubble")
    lines = report_lines(found, loads, cores)
    print("\n".join(lines))
    total = time.time() - t0
    print(f"total {total:.0f} s")
    report = {
        "config": vars(args) | {"output": str(args.output)}, "cores": cores, "cpu": res["profiles"][0].get("device"),
        "load_before": load_before, "load_per_round": loads, "load_after": os.getloadavg(), "busy": max(loads) > cores,
        "profile_seconds": res["profile_s"], "total_seconds": total,
        "speedups_vs_1f1b": speedups,
        "verdicts": [{"target": v.target, "schedule": v.schedule, "met": v.met, "detail": v.detail} for v in found],
        "summary": lines[-1], "rows": rows, "profiles": res["profiles"],
    }
    save(report, path=args.output)


if __name__ == "__main__":
    main()
