"""Data parallelism around the pipeline: gradient reductions overlapped with the passes still to
run, against the same reductions after the step.

PP x DP on local gloo processes (default PP2 x DP2). The passes are emulated
(``EmulatedStage``: each sleeps its profile time, so ranks do not compete for cores), the
reductions are real: every stage holds ``--grad-mb`` MiB of gradients per rank (split between a
rank's stages, so every placement reduces the same bytes per rank), reduced across the replicas
with gloo.

Per schedule, round robin after warm-up, barrier to barrier (``zbsearch.app.demo.mesh_replay``,
what ``zbsearch demo --dp`` runs):
  overlapped  the runtime with the mesh: a stage's reduction starts at its last W (or BW) of the
              step and the runtime waits for it at the end of the step
  after       the runtime on the pipeline group only, then the same reductions (same buckets)
              started and waited for after ``step()``, as a user adds them to a plain loop
  none        the runtime on the pipeline group only, no reduction: the passes alone
  alone       each stage's reduction with nothing else running (all ranks at once)
Prediction of what the reductions add to the passes alone (``none``, measured): the simulator's
timeline of the profile; on each rank, the reductions of its stages in the order their last
backward ends, each starting at that end or when the previous one is done, taking its time
alone. Overlapped: the iteration ends when the last rank's last pass or last reduction ends;
after: each rank's last pass, then all its reductions. Predicted iteration = none + that.
Target: wherever the schedule leaves a rank at least half a reduction of time after a stage's
last W, the overlapped iteration beats reducing after the step by at least half the reduction
time; measured iteration within 5% of the prediction.

Saves bench/results/data_parallel.json.
Run: PYTHONPATH=. python bench/data_parallel.py [--pp 2] [--dp 2] [-m 8] [--grad-mb 8] [--iters 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import save
from pipeline import launch

import zbsearch as zb

UNIT = 2**16  # bytes of emulated activations per M_B


def profile(pp: int, t_f: float, t_b: float, t_w: float) -> zb.Profile:
    """Equal emulated stages (ms), no link time (local processes)."""
    st = zb.StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=1.0, m_b=-0.6, m_w=-0.4)
    return zb.Profile(name=f"emulated-p{pp}", memory_unit="activations", stages=[st] * pp)


def schedules(prof: zb.Profile, m: int) -> list[zb.Schedule]:
    from zbsearch.solver import solve

    out = [zb.build_classic(k, prof, m) for k in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")]
    four = zb.build_classic("interleaved-1f1b", prof, m, chunks=4)  # 4 stages per rank: the earlier ones finish early
    out.append(four.model_copy(update={"kind": "interleaved-1f1b-4"}))
    v = solve(prof, m, "2p", chunks=2, time_limit=10).schedule
    out.append(v.model_copy(update={"kind": "zb-2p-v"}))
    return out


def predict(sched: zb.Schedule, red: dict[int, float]) -> dict:
    """Predicted iteration (ms): reductions overlapped (the simulator's reduction lane,
    ``zbsearch.reductions.lane``), or after the step (module docstring)."""
    from zbsearch.costs import CostModel
    from zbsearch.reductions import lane, last_backward
    from zbsearch.simulator import simulate

    cost = CostModel.from_profile(sched.profile, sched.stage_to_rank)
    tl = simulate(sched.rank_actions, cost)
    t_reduce = [red.get(s, 0.0) for s in range(sched.num_stages)]
    overlapped, after, tails, compute = 0.0, 0.0, {}, max(max(e) for e in tl.end)
    for r, row in enumerate(tl.actions):
        end = max(tl.end[r])
        _, finish = lane(row, tl.end[r], t_reduce, [0.0] * sched.num_stages)
        last = last_backward(row)
        for s, i in last.items():
            tails[s] = end - tl.end[r][i]
        overlapped = max(overlapped, finish)
        after = max(after, end + sum(red[s] for s in last))
    return {"overlapped_extra_ms": overlapped - compute, "after_extra_ms": after - compute, "tail_ms": tails,
            "compute_ms": compute}


def worker(rank, world, send, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist

    from zbsearch.app.demo import mesh_replay
    from zbsearch.distributed.mesh import build_mesh
    from zbsearch.runtime import emulated_loss, emulated_stages

    mesh = build_mesh(pp=cfg["pp"], dp_replicate=cfg["dp"])
    me = mesh["pp"].get_local_rank()
    scheds = schedules(profile(cfg["pp"], *cfg["times"]), cfg["m"])

    def stages_for(sched: zb.Schedule) -> dict:
        chunks = sched.num_stages // cfg["pp"]  # the same gradient bytes per rank in every placement
        grad_bytes = cfg["grad_mb"] * 2**20 / chunks
        stages = emulated_stages(sched.profile, sched.stage_to_rank, bytes_per_unit=UNIT, grad_bytes=grad_bytes)
        return {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == me}

    def batch(sched: zb.Schedule):
        return torch.zeros(cfg["m"], 16), torch.zeros(cfg["m"], 16), emulated_loss

    got = mesh_replay(mesh, scheds, stages_for, batch, cfg["iters"], warmup=cfg["warmup"])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, {k: v["reduction_stage_ms"] for k, v in got.items()})
    if rank != 0:
        return None
    out = {}
    for sched in scheds:
        red: dict[int, float] = {}
        for part in everyone:  # each rank measured its own stages; replicas agree within noise
            for s, v in part[sched.kind].items():
                red[int(s)] = max(red.get(int(s), 0.0), v)
        g = got[sched.kind]
        out[sched.kind] = {"schedule": sched.model_dump_json(), "reduction_alone_ms": red,
                           "overlapped_ms": g["overlapped_runs_ms"], "after_ms": g["after_runs_ms"],
                           "none_ms": g["none_runs_ms"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--grad-mb", type=float, default=24.0, help="MiB of gradients per rank (all its stages)")
    ap.add_argument("--times", type=float, nargs=3, default=[20.0, 20.0, 15.0], metavar=("T_F", "T_B", "T_W"),
                    help="emulated pass times, ms")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("-o", "--output", default="data_parallel")
    args = ap.parse_args()
    cfg = {"pp": args.pp, "dp": args.dp, "m": args.m, "grad_mb": args.grad_mb, "times": args.times,
           "iters": args.iters, "warmup": args.warmup}
    t0 = time.perf_counter()
    res = launch(worker, args.pp * args.dp, cfg)
    rows = {}
    print(f"PP{args.pp} x DP{args.dp}, m={args.m}, {args.grad_mb:g} MiB of gradients per rank, passes {args.times} ms")
    print(f"{'schedule':18} {'reduce':>7} {'passes':>7} {'pred over':>9} {'meas over':>9} {'pred after':>10} "
          f"{'meas after':>10} {'saved':>6} {'max tail':>8}")
    for kind, doc in res.items():
        sched = zb.Schedule.model_validate_json(doc["schedule"])
        red = {int(s): v for s, v in doc["reduction_alone_ms"].items()}
        pred = predict(sched, red)
        over, after = statistics.median(doc["overlapped_ms"]), statistics.median(doc["after_ms"])
        none = statistics.median(doc["none_ms"])
        pred_over, pred_after = none + pred["overlapped_extra_ms"], none + pred["after_extra_ms"]
        per_rank_red = max(sum(red[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == r)
                           for r in range(sched.num_ranks))
        tail = max(pred["tail_ms"].values())
        row = {
            "reduction_per_rank_ms": per_rank_red, "reduction_alone_ms": red, "tail_after_last_w_ms": pred["tail_ms"],
            "predicted_overlapped_ms": pred_over, "predicted_after_ms": pred_after,
            "simulated_passes_ms": pred["compute_ms"], "measured_passes_ms": none,
            "measured_overlapped_ms": over, "measured_after_ms": after,
            "overlapped_runs_ms": doc["overlapped_ms"], "after_runs_ms": doc["after_ms"], "none_runs_ms": doc["none_ms"],
            "saved_ms": after - over,
            "reduction_share": per_rank_red / after,
            "target_applies": tail >= per_rank_red / 2,
            "target_met": (after - over) >= per_rank_red / 2 if tail >= per_rank_red / 2 else None,
            "overlapped_vs_predicted": over / pred_over - 1,
            "after_vs_predicted": after / pred_after - 1,
        }
        rows[kind] = row
        print(f"{kind:18} {per_rank_red:7.1f} {none:7.1f} {pred_over:9.1f} {over:9.1f} {pred_after:10.1f} "
              f"{after:10.1f} {after - over:6.1f} {tail:8.1f}")
    save({"pp": args.pp, "dp": args.dp, "m": args.m, "grad_mb": args.grad_mb, "times_ms": args.times,
          "iters": args.iters, "warmup": args.warmup, "schedules": rows,
          "wall_s": time.perf_counter() - t0}, args.output)


if __name__ == "__main__":
    main()
