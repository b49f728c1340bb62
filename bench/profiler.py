"""Profiler accuracy: the runtime's per-pass times against the profile, on this machine.

The profile is measured on one device, stage after stage, with one CPU thread (as each runtime
rank has). The same model then runs in the runtime, and the trace's F, B and W durations are
compared with the profile's T_F, T_B and T_W (``zbsearch.profiler.runtime_vs_profile``):

  one process  all stages on one rank in a V (ZB-V: F, B and W apart), nothing else competing
               for the core: what the profile is meant to predict.
  p processes  one stage per rank over gloo, ZB-H1, one thread each: the real pipeline. With
               more ranks than free cores, waiting for a core shows up as error.

Wall clock throughout (the test uses CPU time instead, to be immune to load); the load average
is recorded, since on a shared machine it moves every figure; profile and replays alternate
over a few rounds and the median per pass is kept. Prints a table and saves
bench/results/profiler.json.

Run: python bench/profiler.py [--stages 2] [--layers 8 --hidden 128 --seq 128 -b 4] [-m 8] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from common import save

import zbsearch as zb
from zbsearch.distributed import run_local
from zbsearch.formats.trace import Trace
from zbsearch.models import GPTConfig, gpt_batch
from zbsearch.profiler import (
    PassAgreement,
    Settings,
    builtin_gpt,
    profile_one_device,
    runtime_vs_profile,
)
from zbsearch.runtime import PipelineRuntime


def _replay(runtime: PipelineRuntime, rank: int, last: bool, ids, targets, steps: int) -> list[Trace]:
    traces = []
    for step in range(steps + 1):  # the first step warms up
        runtime.step(ids if rank == 0 else None, targets if last else None)
        trace = runtime.trace()
        if step and trace is not None:
            traces.append(trace)
    return traces


def one_process(cfg: GPTConfig, m: int, steps: int) -> list[Trace]:
    spec = builtin_gpt(cfg)
    placeholder = zb.Profile(name="placeholder", memory_unit="activations",
                             stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * (cfg.stages // 2))
    sched = zb.build_classic("zb-v", placeholder, m)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runtime = PipelineRuntime(sched, dict(enumerate(spec.stages)), spec.loss_fn)
        return _replay(runtime, 0, True, *gpt_batch(cfg, m), steps)
    finally:
        dist.destroy_process_group()


def _rank(rank: int, world: int, send, cfg: GPTConfig, profile_json: str, m: int, steps: int) -> list[str] | None:
    spec = builtin_gpt(cfg)
    sched = zb.build_classic("zb-h1", zb.Profile.model_validate_json(profile_json), m)
    last = rank == world - 1
    runtime = PipelineRuntime(sched, {rank: spec.stages[rank]}, spec.loss_fn if last else None)
    traces = _replay(runtime, rank, last, *gpt_batch(cfg, m), steps)
    return [t.model_dump_json() for t in traces] if rank == 0 else None


def _combine(rounds: list[list]) -> list[PassAgreement]:
    """Per pass, the median over rounds of profiled and measured times."""
    return [PassAgreement(rows[0].stage, rows[0].op, statistics.median(r.profiled for r in rows),
                          statistics.median(r.measured for r in rows)) for rows in zip(*rounds)]


def _errors(rows: list[PassAgreement]) -> dict:
    errs = [abs(r.error) for r in rows]
    return {"mean_abs_error": statistics.mean(errs), "max_abs_error": max(errs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2, help="even (one process holds them in a V)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("-b", "--microbatch-size", type=int, default=4)
    ap.add_argument("-m", "--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="profile and replays alternate, so that a change of load hits both")
    args = ap.parse_args()
    if args.stages % 2:
        ap.error("--stages must be even")
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                    microbatch_size=args.microbatch_size, stages=args.stages)
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    local, spread, prof = [], [], None
    for _ in range(args.rounds):
        prof = profile_one_device(builtin_gpt(cfg), Settings(threads=1))
        local.append(runtime_vs_profile(prof, one_process(cfg, args.microbatches, args.steps)))
        traces = run_local(_rank, cfg.stages, cfg, prof.model_dump_json(), args.microbatches, args.steps)[0]
        spread.append(runtime_vs_profile(prof, [Trace.model_validate_json(t) for t in traces]))
        load.append(os.getloadavg()[0])
    local, spread = _combine(local), _combine(spread)
    print(f"{cfg}, m={args.microbatches}, {args.steps} steps x {args.rounds} rounds; load average "
          f"{' -> '.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} cores")
    print(
        f"{'stage':>5} {'op':>3} {'profile ms':>11} {'1 process ms':>13} {'error':>7}"
        f" {f'{cfg.stages} processes ms':>15} {'error':>7}"
    )
    for a, b in zip(local, spread):
        print(
            f"{a.stage:>5} {a.op.value:>3} {a.profiled:>11.3f} {a.measured:>13.3f} {a.error:>+7.1%}"
            f" {b.measured:>15.3f} {b.error:>+7.1%}"
        )
    summary = {"one process": _errors(local), f"{cfg.stages} processes": _errors(spread)}
    for name, s in summary.items():
        print(f"{name}: mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}")
    save({
        "model": vars(args), "device": prof.model_dump()["device"], "torch": torch.__version__,
        "load_average": load, "summary": summary,
        "passes": [{"stage": a.stage, "op": a.op.value, "profiled_ms": a.profiled, "one_process_ms": a.measured,
                    "processes_ms": b.measured} for a, b in zip(local, spread)],
        "last_profile": prof.model_dump(),
    }, "profiler")


if __name__ == "__main__":
    main()
