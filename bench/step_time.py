"""Where a pipeline step's time goes on this host: passes, waits, and the runtime's own host time.

PP ranks on local gloo processes, emulated stages (F 20, B 20, W 15 ms per stage, half per piece
of a V; ``EmulatedStage``) and no data parallelism: 1F1B, ZB-H1 and ZB-V, each ``--iters`` steps
after ``--warmup``, barrier to barrier, each step traced. Per schedule, each rank's step is split
with the runtime's trace into:
  passes          the traced spans of its passes against the given times: what the runtime's
                  pass functions (autograd, the split's bookkeeping) add to each sleep
  dependency      waits the simulator explains from the measured ends (``idle_time``)
  link            waits for a message beyond its producer's end
  local           gaps before actions with no input from another rank
  host per action the runtime's own time between two actions whose inputs were in
                  (``in_step.action_host_times``, the profile's ``t_action``)
against the simulator's makespan on the given times (no host time).

Saves bench/results/step_time.json and prints a markdown table.
Run: PYTHONPATH=. python bench/step_time.py [--pp 2 4] [--iters 6] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import save
from pipeline import launch

import zbsearch as zb

TIMES = (20.0, 20.0, 15.0)


def _profile(pp: int, chunks: int) -> zb.Profile:
    from zbsearch.layout import placement

    t_f, t_b, t_w = (t / chunks for t in TIMES)
    st = zb.StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0 / chunks, m_b=-0.6 / chunks, m_w=-0.4 / chunks)
    return zb.Profile(name=f"emulated-p{pp}", memory_unit="activations", stages=[st] * (pp * chunks),
                      placement=placement(pp, 2, "v") if chunks == 2 else None)


def _schedules(pp: int, m: int) -> list[zb.Schedule]:
    one = _profile(pp, 1)
    return [zb.build_classic("1f1b", one, m), zb.build_classic("zb-h1", one, m), zb.build_classic("zb-v", _profile(pp, 2), m)]


def worker(rank, world, send, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist

    from zbsearch.runtime import PipelineRuntime, emulated_loss, emulated_stages

    out = {}
    for s in _schedules(world, cfg["m"]):
        stages = emulated_stages(s.profile, s.stage_to_rank, bytes_per_unit=2**16)
        mine = {i: st for i, st in enumerate(stages) if s.stage_to_rank[i] == rank}
        last = s.num_stages - 1
        x = torch.zeros(cfg["m"], 16)
        walls, traces = [], []
        with PipelineRuntime(s, mine, emulated_loss if last in mine else None) as rt:
            for i in range(cfg["warmup"] + cfg["iters"]):
                for st in mine.values():
                    st.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                rt.step(x if 0 in mine else None, x if last in mine else None)
                dist.barrier()
                wall = (time.perf_counter() - t0) * 1e3
                trace = rt.trace()
                if i >= cfg["warmup"]:
                    walls.append(wall)
                    if trace is not None:
                        traces.append(trace.model_dump_json())
        out[s.kind] = {"schedule": s.model_dump_json(), "walls_ms": walls, "traces": traces}
    return out if rank == 0 else None


def split(doc: dict) -> dict:
    """One schedule's step split as the module says (ms, means over ranks and steps)."""
    from zbsearch.formats.trace import Trace
    from zbsearch.idle_time import measure_idle_time
    from zbsearch.profiler.in_step import action_host_times

    s = zb.Schedule.model_validate_json(doc["schedule"])
    traces = [Trace.model_validate_json(t) for t in doc["traces"]]
    tl = zb.simulate(s.rank_actions, zb.CostModel.from_profile(s.profile, s.stage_to_rank))
    R = s.num_ranks
    traced = statistics.fmean(sum(ev.dur for ev in tr.rank_events()[r]) / 1e3 for tr in traces for r in range(R))
    idle = measure_idle_time(s, traces)
    actions = statistics.fmean(len(row) for row in s.rank_actions)
    gaps = action_host_times(traces)
    wall = statistics.median(doc["walls_ms"])
    return {"actions_per_rank": actions, "wall_ms": wall, "simulated_ms": tl.makespan,
            "wall_vs_simulated": wall / tl.makespan - 1,
            "passes_given_ms": statistics.fmean(tl.busy), "passes_traced_ms": traced,
            "runtime_in_spans_per_pass_ms": (traced - statistics.fmean(tl.busy)) / actions,
            "dependency_ms": statistics.fmean(i.dependency_ms for i in idle),
            "link_ms": statistics.fmean(i.link_ms for i in idle),
            "local_ms": statistics.fmean(i.local_ms for i in idle), "host_per_action_median_ms": statistics.median(gaps),
            "host_per_action_mean_ms": statistics.fmean(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    runs = []
    print("| PP | schedule | actions per rank | wall vs simulated (given times) | passes given / traced (ms per rank) | "
          "runtime in pass spans (ms per pass) | dependency | link | local | host per action, median / mean (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pp in args.pp:
        load = os.getloadavg()
        got = launch(worker, pp, {"m": args.m, "iters": args.iters, "warmup": args.warmup})
        rows = {kind: split(doc) for kind, doc in got.items()}
        runs.append({"pp": pp, "load_average_before": load, "load_average_after": os.getloadavg(), "schedules": rows})
        for kind, r in rows.items():
            print(f"| {pp} | {kind} | {r['actions_per_rank']:.0f} | {r['wall_ms']:.1f} vs {r['simulated_ms']:.1f} "
                  f"({r['wall_vs_simulated']:+.1%}) | {r['passes_given_ms']:.0f} / {r['passes_traced_ms']:.1f} | "
                  f"{r['runtime_in_spans_per_pass_ms']:.2f} | {r['dependency_ms']:.1f} | {r['link_ms']:.1f} | "
                  f"{r['local_ms']:.1f} | {r['host_per_action_median_ms']:.2f} / {r['host_per_action_mean_ms']:.2f} |",
                  flush=True)
    save({"m": args.m, "iters": args.iters, "warmup": args.warmup, "times_ms": TIMES, "runs": runs}, "step_time")


if __name__ == "__main__":
    main()
