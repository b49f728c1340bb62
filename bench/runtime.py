"""The runtime measured: our schedules against torch.distributed.pipelining's, and against the
simulator's prediction.

Emulated (default p=4, m=8 and 16): every stage is ``zbsearch.runtime.EmulatedStage``, whose
F, B and W sleep for the profile's times (paper-like, tens of ms), so p ranks share a small
machine without competing for cores. In one run, on the same model, after warm-up:
  ours   1F1B, ZB-H1, ZB-2p (the solver, makespan objective, 2p memory; ZB-H2 if the solver is
         not installed) and ZB-V
  torch  Schedule1F1B, ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1) and
         ScheduleZBVZeroBubble
Reported per schedule: iteration time (wall, barrier to barrier, median), throughput relative
to our 1F1B, and for ours the measured makespan and per-rank spans (from the trace) against the
prediction.
Overhead: the same with zero-time passes; the runtime's own time per action.
Real compute: p=2, a small GPT on CPU with one thread per rank, ZB-H1 / ZB-H2 vs 1F1B.

Prints tables and saves bench/results/runtime.json.
Run: python bench/runtime.py [--iters 5] [--ms 8 16] [--skip-real]
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

import zbsearch as zb
from zbsearch.formats.edit import updated
from zbsearch.layout import placement

WIDTH = 16
UNIT = 2**20  # bytes of emulated activations per M_B


def paper_profile(model: str, p: int) -> zb.Profile:
    """The paper's profiled per-stage costs of ``model`` (the paper's Table 5 profiles), on p stages."""
    base = zb.resolve_profile(f"{model}-m24")
    return zb.Profile(
        name=f"{model}-p{p}", memory_unit=base.memory_unit, stages=[base.stages[0]] * p, t_comm=base.t_comm,
        source=f"{base.name}, first stage's costs on {p} stages",
    )


def our_schedules(prof: zb.Profile, m: int) -> list[tuple[str, zb.Schedule]]:
    out = [(k, zb.build_classic(k, prof, m)) for k in ("1f1b", "zb-h1")]
    try:
        from zbsearch.solver import solve

        out.append(("zb-2p", solve(prof, m, "2p", time_limit=20, objective="makespan").schedule))
    except ImportError:
        out.append(("zb-2p (zb-h2)", zb.build_classic("zb-h2", prof, m)))
    out.append(("zb-v", zb.build_classic("zb-v", prof, m)))
    return out


# -- worker side (the timing loop is pipeline.round_robin) ----------------------------------------
def _torch(rank, world, kind, prof, m, time_scale):
    import torch
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from zbsearch.runtime import emulated_loss, emulated_stages

    stage_to_rank = placement(world, 2 if kind == "ScheduleZBVZeroBubble" else 1, "v")
    stages = emulated_stages(prof, stage_to_rank, bytes_per_unit=UNIT, time_scale=time_scale, width=WIDTH)
    S = len(stage_to_rank)
    mine = [s for s in range(S) if stage_to_rank[s] == rank]
    pstages = [PipelineStage(stages[s], s, S, torch.device("cpu")) for s in mine]
    if kind == "Schedule1F1B":
        sched = Schedule1F1B(pstages[0], m, loss_fn=emulated_loss)
    else:
        cls = {"ScheduleInterleavedZeroBubble": ScheduleInterleavedZeroBubble, "ScheduleZBVZeroBubble": ScheduleZBVZeroBubble}[
            kind
        ]
        sched = cls(pstages, m, loss_fn=emulated_loss)
    x, y = torch.zeros(m, WIDTH), torch.zeros(m, WIDTH)

    def step():
        for st in mine:
            stages[st].zero_grad(set_to_none=True)
        sched.step(*((x,) if 0 in mine else ()), target=y if S - 1 in mine else None)

    return step, None


def _row(walls: list[float], traces: list, sched: zb.Schedule | None = None, unit_bytes: float | None = None) -> dict:
    row = {"iteration_ms": statistics.median(walls), "iterations_ms": walls}
    if sched is None:
        return row
    pred = zb.timeline(sched)
    spans = [t.span_ms() for t in traces]
    row.update(
        measured_makespan_ms=statistics.median(t.makespan_ms() for t in traces),
        predicted_makespan_ms=pred.makespan,
        measured_span_ms=[statistics.median(s[r] for s in spans) for r in range(sched.num_ranks)],
        predicted_span_ms=pred.span,
        median_action_ms=_median_ms(traces, lambda e: e.args.op.value),
        median_stage_action_ms=_median_ms(traces, lambda e: f"{e.args.stage}{e.args.op.value}"),
        actions_per_rank=max(len(r) for r in sched.actions),
    )
    if unit_bytes:  # emulated stages hold exactly the profile's activations: compare with the model
        peak = [max(e.args.activations for e in r) for r in traces[-1].rank_events()]
        row.update(
            measured_peak_activations_MiB=[b / 2**20 for b in peak],
            predicted_peak_activations_MiB=[u * unit_bytes / 2**20 for u in pred.peak_memory],
        )
    return row


def _median_ms(traces, key) -> dict[str, float]:
    times: dict[str, list[float]] = {}
    for t in traces:
        for e in t.traceEvents:
            times.setdefault(key(e), []).append(e.dur / 1e3)
    return {k: statistics.median(v) for k, v in sorted(times.items())}


def emulated_worker(rank, world, send, model, ms, iters, warmup, time_scale, torch_kinds) -> dict | None:
    import torch

    from zbsearch.runtime import emulated_loss, emulated_stages

    prof = paper_profile(model, world)
    out = {}
    for m in ms:
        x = torch.zeros(m, WIDTH)
        schedules = {f"ours {name}": sched for name, sched in our_schedules(prof, m)}
        runners = {
            name: ours(rank, sched, emulated_stages(prof, sched.stage_to_rank, UNIT, WIDTH, time_scale), x, x, emulated_loss)
            for name, sched in schedules.items()
        }
        runners.update({f"torch {kind}": _torch(rank, world, kind, prof, m, time_scale) for kind in torch_kinds})
        got = round_robin(runners, iters, warmup)
        if rank == 0:
            out[m] = {name: _row(w, t, schedules.get(name), UNIT) for name, (w, t) in got.items()}
    return out if rank == 0 else None


def real_worker(rank, world, send, m, iters, warmup, hidden, layers) -> dict | None:
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages

    cfg = GPTConfig(layers=layers, hidden=hidden, seq=64, vocab=64, microbatch_size=4, stages=world)
    placeholder = paper_profile("1.5b", world)  # 1F1B's and ZB-H's orders do not depend on costs
    inputs, targets = gpt_batch(cfg, m, seed=0)
    schedules = {f"ours {kind}": zb.build_classic(kind, placeholder, m) for kind in ("1f1b", "zb-h1", "zb-h2")}
    runners = {name: ours(rank, sched, gpt_stages(cfg), inputs, targets, gpt_loss) for name, sched in schedules.items()}
    got = round_robin(runners, iters, warmup)
    if rank != 0:
        return None
    # Predict with the F, B and W times this run measured (ZB-H1 times each pass apart).
    t = _median_ms(got["ours zb-h1"][1], lambda e: f"{e.args.stage}{e.args.op.value}")
    measured = zb.Profile(
        name="gpt-measured", memory_unit="activations",
        stages=[zb.StageCost(t_f=t[f"{s}F"], t_b=t[f"{s}B"], t_w=t[f"{s}W"], m_f=1, m_b=-0.5, m_w=-0.5) for s in range(world)],
    )
    return {name: _row(w, tr, updated(schedules[name], profile=measured)) for name, (w, tr) in got.items()}


# -- report --------------------------------------------------------------------------------------
def _table(title: str, rows: dict, base: str) -> list[str]:
    head = (
        f"{'schedule':34} {'iter ms':>9} {'best ms':>8} {'vs ' + base:>12} {'makespan meas/pred':>19} {'max span meas/pred':>19}"
    )
    lines = [title, head + f" {'peak act. MiB per rank, meas/pred':>34}"]
    ref = rows[base]["iteration_ms"]
    for name, r in rows.items():
        mk = sp = mem = "-"
        if "predicted_makespan_ms" in r:
            mk = f"{r['measured_makespan_ms']:.1f}/{r['predicted_makespan_ms']:.1f}"
            sp = f"{max(r['measured_span_ms']):.1f}/{max(r['predicted_span_ms']):.1f}"
        if "measured_peak_activations_MiB" in r:
            mem = " ".join(
                f"{a:.2g}/{b:.2g}" for a, b in zip(r["measured_peak_activations_MiB"], r["predicted_peak_activations_MiB"])
            )
        lines.append(
            f"{name:34} {r['iteration_ms']:9.1f} {min(r['iterations_ms']):8.1f} {ref / r['iteration_ms']:11.3f}x"
            f" {mk:>19} {sp:>19} {mem:>34}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--model", default="6.2b", help="paper model whose profiled costs the emulation uses")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--real-iters", type=int, default=10, help="timed iterations of the real-compute run (noisier)")
    ap.add_argument("--real-hidden", type=int, default=256)
    ap.add_argument("-o", "--output", type=Path, default=RESULTS / "runtime.json")
    args = ap.parse_args()
    torch_kinds = ["Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]
    report: dict = {"p": args.p, "model": args.model, "iters": args.iters, "warmup": args.warmup, "cpus": os.cpu_count()}
    lines: list[str] = []

    t0 = time.time()
    emulated = launch(emulated_worker, args.p, args.model, args.ms, args.iters, args.warmup, 1.0, torch_kinds)
    report["emulated"] = emulated
    for m, rows in emulated.items():
        lines += _table(f"\nemulated {args.model} costs, p={args.p}, m={m}", rows, "ours 1f1b")
        ours = {k.split(" ", 1)[1]: v for k, v in rows.items() if k.startswith("ours")}
        zb2p = next(k for k in ours if k.startswith("zb-2p"))
        report.setdefault("targets", {})[m] = {
            "max |measured/predicted makespan - 1|": max(
                abs(r["measured_makespan_ms"] / r["predicted_makespan_ms"] - 1) for r in ours.values()
            ),
            "zb-2p vs 1f1b": ours["1f1b"]["iteration_ms"] / ours[zb2p]["iteration_ms"],
            "ours vs torch, same kind (>= 1 is faster)": {
                "1f1b": rows["torch Schedule1F1B"]["iteration_ms"] / ours["1f1b"]["iteration_ms"],
                "zb-h1": rows["torch ScheduleInterleavedZeroBubble"]["iteration_ms"] / ours["zb-h1"]["iteration_ms"],
                "zb-v": rows["torch ScheduleZBVZeroBubble"]["iteration_ms"] / ours["zb-v"]["iteration_ms"],
            },
        }
    overhead = launch(emulated_worker, args.p, args.model, [16], args.iters, args.warmup, 0.0, torch_kinds)[16]
    report["overhead"] = overhead
    lines += _table(f"\nzero-time passes (runtime overhead), p={args.p}, m=16", overhead, "ours 1f1b")
    lines.append(
        "median time inside one action (ms): "
        + "; ".join(
            f"{k}: " + ", ".join(f"{op} {v:.3f}" for op, v in r["median_action_ms"].items())
            for k, r in overhead.items()
            if "median_action_ms" in r
        )
    )
    if not args.skip_real:
        real = launch(real_worker, 2, 8, args.real_iters, args.warmup, args.real_hidden, 4)
        report["real"] = real
        lines += _table(
            f"\nreal compute: small GPT (hidden {args.real_hidden}, 4 layers, seq 64), CPU, 1 thread per rank, p=2, m=8 "
            "(predicted from the F/B/W times measured in the ZB-H1 run)", real, "ours 1f1b",
        )
    lines.append("\ntargets: " + json.dumps(report["targets"], indent=1))
    lines.append(f"\ntotal {time.time() - t0:.0f} s")
    print("\n".join(lines))
    save(report, path=args.output)


if __name__ == "__main__":
    main()
