"""Overlapped MoE pairs run for real: emulated passes with real gloo all-to-all, PP2 x EP2.

Four local gloo processes: a pipeline of 2 ranks, each pipeline position held by an expert
group of 2 (the data-parallel peers). Each stage's passes are emulated: its compute sleeps the
profile's time while holding the process's one "device" (a lock: two passes of one process
never compute at once, as on one accelerator; oversleeping made up as in ``EmulatedStage``),
and its expert all-to-all is real: in F, a dispatch and a combine of ``--payload-kib`` KiB per
rank across the expert group (the same autograd all-to-all as ``zbsearch.models.moe``: its
backward is the mirror pair, in B); W sleeps its time. A pass waiting in an all-to-all does
not hold the device, so in an overlapped pair the other pass computes meanwhile.

Per schedule (DualPipeV with and without its overlapped pairs, ZB-V, 1F1B; m = ``-m``):
  1. profile: every stage measured as ``zbsearch profile --ep`` measures one
     (``zbsearch.profiler.pairs``, every expert peer at once): its F, B and W timed alone with
     the runtime's split passes, its forward and fused backward as the runtime runs them before
     and as a BW (``t_ff``, ``t_bw``), the all-to-all inside F and B, and a pair (an F on a thread
     while another microbatch's B runs, as the runtime runs one) against the two alone: the
     stage's ``pair_exposed``. The profile takes the first expert peer's medians, as the
     profiler takes its group's first process's. Then, as ``zbsearch profile`` under torchrun
     does (``zbsearch.profiler.in_step``), the stages run a few calibration steps of the
     runtime (1F1B, or ZB-V's order on the V; split and fused; every expert peer's pipeline at
     once, so their all-to-all meet): each pass costs its median in those steps where they
     timed it, and the runtime's host time between actions there is the profile's
     ``t_action``;
  2. predict: the simulator's makespan on that profile (what ``zbsearch simulate`` predicts),
     and, to show what the measured share does, the same with ``pair_exposed`` left out; and
     the makespan on the profile without the steps (passes timed alone, no ``t_action``);
  3. measure: ``--iters`` steps after ``--warmup``, barrier to barrier; median; and each step's
     trace, whose passes are compared with the profile kind by kind (``compare_pass_times``,
     what ``zbsearch simulate --measured`` shows): where a prediction misses, they say whether
     the passes ran longer than profiled or the time went between them.

Saves bench/results/moe_run.json; ``python bench/report.py moe-run`` writes the report.
Run: PYTHONPATH=. python bench/moe_run.py [-m 8] [--iters 8] [--warmup 2] [--payload-kib 1024] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

import zbsearch as zb
from zbsearch.formats.mesh import ProfileMesh

PP, EP = 2, 2
COMPUTE = {"f": 12.0, "b": 12.0, "w": 8.0}  # ms of emulated compute per stage (a V's pieces: half)
ROWS = 8  # rows of the stage boundary (small: the pipeline's own messages cost little)
_DEVICE = threading.Lock()  # this process's one device: compute passes take turns


def _busy(ms: float) -> None:
    """Emulated compute: the device held for ``ms``, oversleeping made up as the runtime's
    emulated stages make it up (``zbsearch.runtime.emulation``)."""
    from zbsearch.runtime.emulation import _sleep

    with _DEVICE:
        _sleep(ms / 1e3)


class _Compute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f_ms: float, b_ms: float):
        _busy(f_ms)
        ctx.b_ms = b_ms
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _busy(ctx.b_ms)
        return g.clone(), None, None


class _Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, w_ms: float):
        ctx.w_ms = w_ms
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        _busy(ctx.w_ms)
        return g.clone(), None


class EmulatedMoEStage(nn.Module):
    """F: compute, dispatch, compute, combine; B the mirrors; W the weight path's sleep."""

    split_first_stage = True

    def __init__(self, scale: float, payload_kib: int, groups) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(ROWS, 256))
        self.scale, self.groups = scale, groups
        self.repeat = max(1, payload_kib * 1024 // (ROWS * 256 * 4))

    def forward(self, x):
        from zbsearch.models.moe import _AllToAll

        c = {k: v * self.scale for k, v in COMPUTE.items()}
        h = x + _Weight.apply(self.w, c["w"])
        h = _Compute.apply(h, c["f"] / 2, c["b"] / 2)
        big = h.repeat(self.repeat, 1)  # the tokens sent to the experts
        half = big.shape[0] // EP
        sent = _AllToAll.apply(big, [half] * EP, [half] * EP, self.groups)
        sent = _Compute.apply(sent, c["f"] / 2, c["b"] / 2)
        back = _AllToAll.apply(sent, [half] * EP, [half] * EP, self.groups)
        return back.view(self.repeat, ROWS, -1).sum(0) / self.repeat


def _schedules(m: int) -> list[zb.Schedule]:
    prof = zb.Profile(name="unit", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * PP)
    return [zb.build_classic("1f1b", prof, m), zb.build_classic("zb-v", prof, m),
            zb.build_classic("dualpipe-v", prof, m, overlap=False), zb.build_classic("dualpipe-v", prof, m, overlap=True)]


def _worker(rank: int, world: int, send, texts: list[str], iters: int, warmup: int, payload_kib: int,
            rounds: int) -> list[dict]:
    from zbsearch.distributed.mesh import build_mesh, expert_groups
    from zbsearch.profiler.pairs import pair_rounds
    from zbsearch.runtime import PipelineRuntime

    mesh = build_mesh(pp=PP, dp_replicate=EP)
    groups = expert_groups(mesh)
    me = mesh["pp"].get_local_rank()
    out = []
    for text in texts:
        sched = zb.Schedule.model_validate_json(text)
        scale = PP / sched.num_stages
        stages = [EmulatedMoEStage(scale, payload_kib, groups) for _ in range(sched.num_stages)]
        mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == me}
        # 1. profile each of this rank's stages as the profiler does, on the expert group
        held = sorted(mine)
        inputs = [(torch.zeros(ROWS, 256, requires_grad=s > 0),) for s in held]
        got = pair_rounds([mine[s] for s in held], inputs, [None] * len(held), groups.backward, rounds, 2)
        profiled = {s: asdict(r) for s, r in zip(held, got)}
        fused = {s: _fused_times(mine[s], x, groups.backward, rounds) for s, x in zip(held, inputs)}
        loss = (lambda out, y: out.sum() * 0) if sched.num_stages - 1 in mine else None
        calibration = _calibration_steps(sched.stage_to_rank, mine, mesh["pp"].get_group(), rounds)
        times, traces = [], []
        with PipelineRuntime(sched, mine, loss, mesh=mesh, timeout=120, check_model=False) as rt:
            x = torch.zeros(ROWS * sched.num_microbatches, 256)
            for i in range(warmup + iters):
                dist.barrier()
                t0 = time.perf_counter()
                rt.step(x if 0 in mine else None, x if sched.num_stages - 1 in mine else None)
                dist.barrier()
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
                    trace = rt.trace()  # (collective on the pipeline; outside the timed step)
                    if trace is not None:
                        traces.append(trace.model_dump_json())
        out.append({"kind": sched.kind, "ep_rank": groups.rank, "profiled": profiled, "fused": fused, "iteration_ms": times,
                    "traces": traces, "calibration": calibration})
    return out


def _calibration_steps(owner: list[int], mine: dict, group, rounds: int) -> dict[str, list[str]] | None:
    """The profiler's calibration steps (``in_step``) of this rank's stages on its pipeline:
    their traces as JSON per order on the pipeline's rank 0 (None elsewhere)."""
    from zbsearch.profiler.in_step import calibration_orders, calibration_steps, run_in_steps

    orders = calibration_orders(owner)
    assert orders is not None  # one stage per rank, or the V
    x = torch.zeros(ROWS, 256)
    got = run_in_steps(orders, mine, (x,) if 0 in mine else (), lambda out, y: out.sum() * 0, x,
                       calibration_steps(rounds, orders), group=group, device=torch.device("cpu"), timeout=120.0,
                       keep_heap=False)
    return None if got is None else {way: [t.model_dump_json() for t in traces] for way, traces in got.items()}


def _fused_times(stage: nn.Module, x: tuple, group, rounds: int) -> tuple[float, float]:
    """(t_ff, t_bw): the median ms of the forward before a fused backward and of the fused
    backward, as the profiler measures them (after 2 untimed rounds; the expert peers meet at a
    barrier before each timed pass, as in ``pair_rounds``)."""
    from zbsearch.runtime.split import backward_full, forward_pass

    ff, bw = [], []
    with torch.enable_grad():
        for k in range(2 + rounds):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fp = forward_pass(stage, x, split=False)
            t1 = time.perf_counter()
            dist.barrier(group=group)
            t2 = time.perf_counter()
            backward_full(fp, [torch.ones_like(o) for o in fp.outputs])
            t3 = time.perf_counter()
            if k >= 2:
                ff.append((t1 - t0) * 1e3)
                bw.append((t3 - t2) * 1e3)
    stage.zero_grad(set_to_none=True)
    return statistics.median(ff), statistics.median(bw)


def _profile(got: list, i: int, num_stages: int, steps: bool = True) -> zb.Profile:
    """Schedule ``i``'s profile: per stage, the first expert peer's medians, as ``zbsearch profile
    --ep`` takes its group's first process's; with ``steps``, each pass at its median in that
    peer's calibration steps where they timed it, and their host time per action (``t_action``:
    the mean gap, as the profiler takes it)."""
    from zbsearch.formats.trace import Trace
    from zbsearch.profiler.in_step import action_host_times, in_step_times
    from zbsearch.profiler.pairs import PairRounds

    rounds: dict[int, PairRounds] = {}
    fused: dict[int, tuple[float, float]] = {}
    calibration = None
    for per_rank in got:
        if per_rank[i]["ep_rank"] == 0:
            rounds.update({int(s): PairRounds(**r) for s, r in per_rank[i]["profiled"].items()})
            fused.update({int(s): tuple(f) for s, f in per_rank[i]["fused"].items()})
            if per_rank[i]["calibration"] is not None:
                calibration = {way: [Trace.model_validate_json(t) for t in ts] for way, ts in per_rank[i]["calibration"].items()}
    in_step = in_step_times(calibration, num_stages) if steps and calibration else [{} for _ in range(num_stages)]
    gaps = action_host_times([t for ts in calibration.values() for t in ts]) if steps and calibration else []
    stages = []
    for s in range(num_stages):
        r, (t_ff, t_bw) = rounds[s], fused[s]
        t_f, t_b, t_w = (statistics.median(x) for x in (r.t_f, r.t_b, r.t_w))
        timed = {k: st.median for k, st in in_step[s].items()}
        t_f, t_b, t_w = timed.get("t_f", t_f), timed.get("t_b", t_b), timed.get("t_w", t_w)
        t_ff, t_bw = timed.get("t_ff", t_ff), timed.get("t_bw", t_bw)
        stages.append(zb.StageCost(t_f=t_f, t_b=t_b, t_w=t_w, t_ff=t_ff, t_bw=t_bw, m_f=1, m_b=-0.5, m_w=-0.5,
                                   a_f=min(statistics.median(r.a_f), t_f, t_ff),
                                   a_b=min(statistics.median(r.a_b), t_b, t_bw), pair_exposed=r.exposed))
    return zb.Profile(name="moe-emulated", memory_unit="activations", stages=stages,
                      mesh=ProfileMesh(pp=num_stages, ep=EP), t_action=statistics.fmean(gaps) if gaps else None)


def _predict(sched: zb.Schedule, prof: zb.Profile) -> tuple[float, bool]:
    """The simulator's makespan on ``prof``, and whether it priced the schedule's pairs (its
    makespan differs from the same order run one pass after the other)."""
    from zbsearch.prediction import timeline

    span = max(timeline(sched.model_copy(update={"profile": prof})).span)
    if sched.overlapped is None:
        return span, False
    alone = max(timeline(sched.model_copy(update={"profile": prof, "overlapped": None})).span)
    return span, span != alone


def _passes(sched: zb.Schedule, traces: list[str]) -> dict[str, float]:
    """Per kind of pass (F, B, W, BW, F+B pairs), measured over profiled time on the traced steps,
    over every rank and replica."""
    from zbsearch.formats.trace import Trace
    from zbsearch.pass_times import compare_pass_times

    sums: dict[str, list[float]] = {}
    for row in compare_pass_times(sched, [Trace.model_validate_json(t) for t in traces]):
        acc = sums.setdefault(row.kind, [0.0, 0.0])
        acc[0] += row.count * row.measured_ms
        acc[1] += row.count * row.predicted_ms
    return {k: m / p for k, (m, p) in sums.items() if p > 0}


def _rank_busy(traces: list[str], ranks: int) -> list[float]:
    """Per pipeline rank, the mean ms its passes held it in a traced step (the union of their
    spans: a pair's two passes share one), over the steps and replicas."""
    from zbsearch.formats.trace import Trace

    per: list[list[float]] = [[] for _ in range(ranks)]
    for text in traces:
        spans: dict[int, list[tuple[float, float]]] = {}
        for ev in Trace.model_validate_json(text).traceEvents:
            spans.setdefault(ev.pid, []).append((ev.ts, ev.ts + ev.dur))
        for r, got in spans.items():
            total, end = 0.0, float("-inf")
            for b, e in sorted(got):
                total += max(0.0, e - max(b, end))
                end = max(end, e)
            per[r].append(total / 1e3)
    return [statistics.mean(x) if x else 0.0 for x in per]


def main() -> None:
    from common import save

    from zbsearch.distributed import run_local
    from zbsearch.prediction import timeline

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--payload-kib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=10, help="timed profiling rounds per stage (after 2 untimed)")
    args = ap.parse_args()
    scheds = _schedules(args.m)
    t0 = time.time()
    load_before = os.getloadavg()
    texts = [s.model_dump_json() for s in scheds]
    got = run_local(_worker, PP * EP, texts, args.iters, args.warmup, args.payload_kib, args.rounds, timeout=3600)
    rows = []
    for i, sched in enumerate(scheds):
        prof = _profile(got, i, sched.num_stages)
        predicted, priced = _predict(sched, prof)
        alone = _predict(sched, _profile(got, i, sched.num_stages, steps=False))[0]
        rule = _predict(sched, prof.model_copy(update={"stages": [c.model_copy(update={"pair_exposed": None})
                                                                  for c in prof.stages]}))[0]
        measured = _median_step(got, i, args.iters)
        traced = sched.model_copy(update={"profile": prof})
        traces = [t for per_rank in got for t in per_rank[i]["traces"]]
        passes = _passes(traced, traces)
        tl = timeline(traced)
        pairs = sum(len(r) for r in sched.overlapped or [])
        rows.append({"kind": sched.kind, "pairs": pairs, "profile": prof.model_dump(mode="json", exclude_none=True),
                     "predicted_ms": predicted, "pairs_priced": priced, "predicted_fully_hidden_ms": rule,
                     "predicted_passes_alone_ms": alone, "t_action_ms": prof.t_action or 0.0,
                     "vs_passes_alone": measured / alone - 1,
                     "measured_ms": measured, "vs_predicted": measured / predicted - 1,
                     "iteration_ms": [max(per_rank[i]["iteration_ms"][k] for per_rank in got) for k in range(args.iters)],
                     "pass_ratio": passes, "busy_predicted_ms": list(tl.busy),
                     "busy_measured_ms": _rank_busy(traces, sched.num_ranks)})
        e = [c.pair_exposed for c in prof.stages if c.pair_exposed is not None]
        print(f"{sched.kind:18s} pairs {pairs:2d}  pair_exposed {min(e, default=0):.2f}-{max(e, default=0):.2f}  "
              f"predicted {predicted:7.1f} (fully hidden {rule:7.1f}, passes alone {alone:7.1f})  measured {measured:7.1f}  "
              f"({measured / predicted - 1:+.1%})  passes " + " ".join(f"{k} {v:.2f}" for k, v in passes.items()), flush=True)
    doc = {"pp": PP, "ep": EP, "m": args.m, "iters": args.iters, "warmup": args.warmup, "payload_kib": args.payload_kib,
           "rounds": args.rounds, "compute_ms": COMPUTE, "seconds": round(time.time() - t0, 1),
           "load_before": list(load_before), "rows": rows}
    save(doc, "moe_run")
    print("report: python bench/report.py moe-run")


def _median_step(got: list, i: int, iters: int) -> float:
    """Schedule ``i``'s median iteration, each the slowest rank's."""
    return statistics.median(max(per_rank[i]["iteration_ms"][k] for per_rank in got) for k in range(iters))


if __name__ == "__main__":
    main()
