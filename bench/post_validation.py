"""Optimizer post-validation vs a synchronous grad-norm all-reduce, timed emulation, p=4, m=8.

Four gloo ranks run PipelineRuntime on EmulatedStage stages: every pass sleeps for the paper's
profiled 1.5B time (arXiv 2401.10241, its m=24 profile, per-stage times doubled for 4
stages), so 4 ranks fit on 2 cores. The optimizer is AdamW with clipping; its step sleeps
T_STEP, what AdamW with fp32 master weights takes on such a stage (375M parameters, about 30
bytes moved per parameter at 1.5 TB/s: 7.5 ms), and a post-validation snapshot sleeps T_SNAP
to copy it (parameters and both moments: 24 bytes per parameter, 6 ms). All modes run in the
same processes, interleaved, on each schedule:

  sync      runtime.step(), then SyncClippedOptimizer.step(): the norm is exchanged (blocking
            all-gather) before any rank steps
  validate  PostValidatedOptimizer, validate() before each iteration
  defer     PostValidatedOptimizer(defer=True), the next iteration runs before validation

with PipelineRuntime as it is (no barrier between steps) and with a barrier over all ranks
before each step: such a barrier is itself the global synchronisation post-validation
removes. "clip" runs clip every step (max_norm tiny): every optimistic step rolls back, and
with defer every iteration runs twice.

What to expect: with the synchronous exchange, a rank's next iteration cannot start before
the last rank has finished (the period is the makespan); with deferred post-validation there
is no global synchronisation and the period is the longest per-stage span, the paper's
objective. The script prints both from the simulator, for this run and for the paper's setting (p=8, m=24), where the gap between
them is the cost of the synchronous all-reduce that the paper measured at about 8%.

Prints tables; saves bench/results/post_validation.json.
Run: python bench/post_validation.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from common import save

from zbsearch import build_classic, resolve_profile, timeline
from zbsearch.distributed import run_local
from zbsearch.formats.edit import updated
from zbsearch.runtime import PipelineRuntime, emulated_loss, emulated_stages
from zbsearch.runtime import post_validation as pv
from zbsearch.solver.solve import solve

P, M = 4, 8
T_STEP, T_SNAP = 7.5e-3, 6.0e-3
WARMUP, MEASURED, ROUNDS = 1, 6, 2
MODES = [  # (name, optimizer mode, barrier before each step, max_norm)
    ("sync", "sync", True, 1e9), ("defer", "defer", True, 1e9),
    ("sync", "sync", False, 1e9), ("validate", "validate", False, 1e9), ("defer", "defer", False, 1e9),
    ("validate clip", "validate", False, 1e-9), ("defer clip", "defer", False, 1e-9),
]
PAPER = [("1.5b-m24", 24), ("6.2b-m24", 24)]  # simulated only: p=8 as in the paper


def profile_p4():
    prof = resolve_profile("1.5b-m24")
    k = prof.num_stages / P
    st = prof.stages[0]
    stage = updated(st, t_f=st.t_f * k, t_b=st.t_b * k, t_w=st.t_w * k)
    return updated(prof, stages=[stage] * P, name="1.5b-m24-p4", t_comm=prof.t_comm)


class _TimedAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        time.sleep(T_STEP)
        return super().step(closure)


class _TimedSnapshot(pv._Snapshot):
    """Copying and restoring a real stage's parameters and moments takes time; these are tiny."""

    def __init__(self, *args) -> None:
        time.sleep(T_SNAP)
        super().__init__(*args)

    def restore(self) -> None:
        time.sleep(T_SNAP)
        super().restore()


def _measure(rank: int, schedule, mode: str, barrier: bool, max_norm: float) -> tuple[float, dict]:
    all_stages = emulated_stages(schedule.profile, schedule.stage_to_rank)
    stages = {s: all_stages[s] for s, r in enumerate(schedule.stage_to_rank) if r == rank}
    last = schedule.num_stages - 1
    runtime = PipelineRuntime(schedule, stages, emulated_loss if last in stages else None)
    inner = _TimedAdamW([p for s in sorted(stages) for p in stages[s].parameters()], lr=1e-3)
    if mode == "sync":
        opt = pv.SyncClippedOptimizer(inner, max_norm, stages=stages)
    else:
        opt = pv.PostValidatedOptimizer(inner, max_norm, stages=stages, defer=mode == "defer")
        opt.attach(runtime)
    width = all_stages[0].weight.numel()
    x, y = torch.randn(M, width), torch.randn(M, width)

    def step() -> None:
        if barrier:
            dist.barrier()
        runtime.step(x, y)

    ends = []
    for _ in range(WARMUP + MEASURED):
        if mode == "validate":
            opt.validate()
        step()
        if mode == "sync":
            opt.step()
            opt.zero_grad()
        while mode == "defer" and opt.replay:
            step()
        ends.append(time.perf_counter())
    if mode != "sync":
        opt.validate()
    period = (ends[-1] - ends[WARMUP - 1]) / MEASURED
    return period, dict(getattr(opt, "counts", {}))


def _worker(rank: int, world: int, send, schedules: dict) -> list[dict] | None:
    pv._Snapshot = _TimedSnapshot
    rows = []
    for rnd in range(ROUNDS):
        for name, schedule in schedules.items():
            for label, mode, barrier, max_norm in MODES:
                period, counts = _measure(rank, schedule, mode, barrier, max_norm)
                periods = [None] * P
                dist.all_gather_object(periods, (period, counts))
                rows.append(dict(round=rnd, schedule=name, mode=label, barrier=barrier,
                                 period_ms=max(p for p, _ in periods) * 1e3, counts=[c for _, c in periods]))
    return rows if rank == 0 else None


def main() -> None:
    t0 = time.perf_counter()
    prof = profile_p4()
    schedules = {"zb-h1": build_classic("zb-h1", prof, M), "zb-2p": solve(prof, M, "2p", time_limit=10).schedule}
    predicted = {f"{name} p={P} m={M}": _spans(s) for name, s in schedules.items()}
    for model, m in PAPER:
        paper_prof = resolve_profile(model)
        for kind in ("zb-h1", "zb-h2", "zb-v"):
            predicted[f"{kind} {model} p=8"] = _spans(build_classic(kind, paper_prof, m))
        predicted[f"zb-2p {model} p=8"] = _spans(solve(paper_prof, m, "2p", time_limit=10).schedule)
    rows = run_local(_worker, P, schedules, timeout=3600)[0]

    table = []
    for name in schedules:
        for label, _, barrier, _ in MODES:
            runs = [r for r in rows if r["schedule"] == name and r["mode"] == label and r["barrier"] == barrier]
            table.append(dict(schedule=name, mode=label, barrier=barrier,
                              period_ms=statistics.median(r["period_ms"] for r in runs),
                              rounds_ms=[round(r["period_ms"], 2) for r in runs], counts=runs[-1]["counts"]))
        for barrier in (True, False):
            base = next(
                t["period_ms"] for t in table if t["schedule"] == name and t["mode"] == "sync" and t["barrier"] == barrier
            )
            for t in table:
                if t["schedule"] == name and t["barrier"] == barrier:
                    t["vs_sync"] = t["period_ms"] / base - 1

    print("simulated: the period with a synchronous exchange (makespan) vs with post-validation (max span)")
    print(f"{'schedule':>26} {'max span ms':>12} {'makespan ms':>12} {'throughput lost to sync':>24}")
    for name, pr in predicted.items():
        print(f"{name:>26} {pr['span_ms']:>12.1f} {pr['makespan_ms']:>12.1f} {pr['sync_cost']:>24.1%}")
    print(f"\nmeasured: p={P} m={M}, T_F={prof.stages[0].t_f:.1f} ms, T_B={prof.stages[0].t_b:.1f} ms, "
          f"T_W={prof.stages[0].t_w:.1f} ms, optimizer step {T_STEP * 1e3:.1f} ms, snapshot {T_SNAP * 1e3:.1f} ms")
    print(f"{'schedule':>8} {'runtime':>11} {'mode':>13} {'iteration ms':>13} {'vs sync':>8}  rounds; steps on rank 0 / rank 3")
    for t in table:
        c = t["counts"]
        how = "" if t["mode"] == "sync" else f"; {_fmt(c[0])} / {_fmt(c[-1])}"
        print(f"{t['schedule']:>8} {'barrier' if t['barrier'] else 'no barrier':>11} {t['mode']:>13} "
              f"{t['period_ms']:>13.1f} {t['vs_sync']:>+8.1%}  {t['rounds_ms']}{how}")
    elapsed = time.perf_counter() - t0
    print(f"median of {ROUNDS} interleaved rounds of {MEASURED} iterations each; {elapsed:.0f} s")
    save({
        "benchmark": "post_validation", "p": P, "m": M,
        "t_step_ms": T_STEP * 1e3, "t_snapshot_ms": T_SNAP * 1e3, "predicted": predicted,
        "elapsed_s": elapsed, "python": sys.version.split()[0], "torch": torch.__version__, "rows": table,
    }, "post_validation")


def _spans(schedule) -> dict:
    tl = timeline(schedule)
    span, makespan = max(tl.span), tl.makespan
    # throughput lost to the synchronous exchange: the iteration takes the makespan, not the span
    return dict(span_ms=span, makespan_ms=makespan, sync_cost=1 - span / makespan)


def _fmt(counts: dict) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items()))


if __name__ == "__main__":
    main()
