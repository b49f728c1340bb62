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
  1. calibrate: every stage's all-to-all time inside one F and one B, timed around the
     collectives (``all_to_all_time``) over sequential passes;
  2. predict: the simulator's makespan on the profile those times give (t_f = compute + a_f,
     t_b = compute + a_b, with a_f, a_b recorded); a pair is priced by the simulator where
     it knows pairs (``Schedule.overlapped``), else the prediction is the sequential one and the
     report says so;
  3. measure: ``--iters`` steps after ``--warmup``, barrier to barrier; median.

Saves bench/results/moe_run.json and writes bench/reports/moe-run_<cpu>_<date>.md.
Run: PYTHONPATH=. python bench/moe_run.py [-m 8] [--iters 8] [--warmup 2] [--payload-kib 1024]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import threading
import time
from pathlib import Path

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


def _worker(rank: int, world: int, send, texts: list[str], iters: int, warmup: int, payload_kib: int) -> list[dict]:
    from zbsearch.distributed.mesh import build_mesh, expert_groups
    from zbsearch.models.moe import all_to_all_time
    from zbsearch.runtime import PipelineRuntime
    from zbsearch.runtime.split import backward_input, backward_weight, forward_pass

    mesh = build_mesh(pp=PP, dp_replicate=EP)
    groups = expert_groups(mesh)
    me = mesh["pp"].get_local_rank()
    out = []
    for text in texts:
        sched = zb.Schedule.model_validate_json(text)
        scale = PP / sched.num_stages
        stages = [EmulatedMoEStage(scale, payload_kib, groups) for _ in range(sched.num_stages)]
        mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == me}
        # 1. calibrate each of this rank's stages: all-to-all inside one F and one B
        a = {}
        for s, st in mine.items():
            fs, bs = [], []
            for i in range(12):
                x = torch.zeros(ROWS, 256, requires_grad=s > 0)
                dist.barrier(group=groups.backward)  # the peers start together: a sample is the transfer, not the skew
                with all_to_all_time() as clock:
                    fp = forward_pass(st, (x,))
                    f = clock.forward
                    _, w = backward_input(fp, [torch.ones(ROWS, 256)])
                    b = clock.backward
                    backward_weight(w)
                if i >= 2:
                    fs.append(f * 1e3)
                    bs.append(b * 1e3)
            a[s] = (statistics.median(fs), statistics.median(bs))
        loss = (lambda out, y: out.sum() * 0) if sched.num_stages - 1 in mine else None
        times = []
        with PipelineRuntime(sched, mine, loss, mesh=mesh, timeout=120, check_model=False) as rt:
            x = torch.zeros(ROWS * sched.num_microbatches, 256)
            for i in range(warmup + iters):
                dist.barrier()
                t0 = time.perf_counter()
                rt.step(x if 0 in mine else None, x if sched.num_stages - 1 in mine else None)
                dist.barrier()
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
        out.append({"kind": sched.kind, "a": a, "iteration_ms": times})
    return out


def _profile(stage_a: dict[int, tuple[float, float]], num_stages: int) -> zb.Profile:
    scale = PP / num_stages
    c = {k: v * scale for k, v in COMPUTE.items()}
    stages = []
    for s in range(num_stages):
        a_f, a_b = stage_a[s]
        stages.append(zb.StageCost(t_f=c["f"] + a_f, t_b=c["b"] + a_b, t_w=c["w"], t_bw=c["b"] + a_b + c["w"], m_f=1,
                                   m_b=-0.5, m_w=-0.5, a_f=a_f, a_b=a_b))
    return zb.Profile(name="moe-emulated", memory_unit="activations", stages=stages,
                      mesh=ProfileMesh(pp=num_stages, ep=EP))


def _predict(sched: zb.Schedule, prof: zb.Profile) -> tuple[float, bool]:
    """The simulator's makespan on ``prof``, and whether it priced the schedule's pairs (its
    makespan differs from the same order run one pass after the other)."""
    from zbsearch.prediction import timeline

    span = max(timeline(sched.model_copy(update={"profile": prof})).span)
    if sched.overlapped is None:
        return span, False
    alone = max(timeline(sched.model_copy(update={"profile": prof, "overlapped": None})).span)
    return span, span != alone


def main() -> None:
    from common import save

    from zbsearch.distributed import run_local

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--payload-kib", type=int, default=1024)
    args = ap.parse_args()
    scheds = _schedules(args.m)
    t0 = time.time()
    texts = [s.model_dump_json() for s in scheds]
    got = run_local(_worker, PP * EP, texts, args.iters, args.warmup, args.payload_kib, timeout=3600)
    # the same passes with a token all-to-all (1 KiB): what the runtime and the machine add to the passes
    small = run_local(_worker, PP * EP, texts, args.iters, args.warmup, 1, timeout=3600)
    rows = []
    for i, sched in enumerate(scheds):
        prof, a = _calibrated(got, i, sched.num_stages)
        predicted, priced = _predict(sched, prof)
        measured = _median_step(got, i, args.iters)
        predicted_small = _predict(sched, _calibrated(small, i, sched.num_stages)[0])[0]
        on_passes = _median_step(small, i, args.iters) + predicted - predicted_small
        pairs = sum(len(r) for r in sched.overlapped or [])
        rows.append({"kind": sched.kind, "pairs": pairs, "a_f": [a[s][0] for s in range(sched.num_stages)],
                     "a_b": [a[s][1] for s in range(sched.num_stages)], "predicted_ms": predicted,
                     "pairs_priced": priced, "measured_ms": measured, "vs_predicted": measured / predicted - 1,
                     "small_payload_measured_ms": _median_step(small, i, args.iters),
                     "small_payload_predicted_ms": predicted_small, "on_passes_ms": on_passes,
                     "vs_on_passes": measured / on_passes - 1})
        print(f"{sched.kind:18s} pairs {pairs:2d}  a_f {a[0][0]:.1f}  predicted {predicted:7.1f}  on passes {on_passes:7.1f}"
              f"  measured {measured:7.1f}  ({measured / predicted - 1:+.1%}, {measured / on_passes - 1:+.1%})", flush=True)
    doc = {"pp": PP, "ep": EP, "m": args.m, "iters": args.iters, "warmup": args.warmup, "payload_kib": args.payload_kib,
           "compute_ms": COMPUTE, "seconds": round(time.time() - t0, 1), "rows": rows}
    path = save(doc, "moe_run")
    _report(doc, path)


def _calibrated(got: list, i: int, num_stages: int) -> tuple[zb.Profile, dict[int, tuple[float, float]]]:
    """Schedule ``i``'s profile from its calibration: per stage (a_f, a_b), the expert peers'
    smaller (the larger adds the wait for the later peer)."""
    stage_a: dict[int, tuple[float, float]] = {}
    for per_rank in got:
        for s, (f, b) in per_rank[i]["a"].items():
            old = stage_a.get(int(s), (float("inf"), float("inf")))
            stage_a[int(s)] = (min(old[0], f), min(old[1], b))
    return _profile(stage_a, num_stages), stage_a


def _median_step(got: list, i: int, iters: int) -> float:
    """Schedule ``i``'s median iteration, each the slowest rank's."""
    return statistics.median(max(per_rank[i]["iteration_ms"][k] for per_rank in got) for k in range(iters))


def _report(doc: dict, path: Path) -> None:
    import json

    saved = json.loads(path.read_text())["machine"]
    cpu = "epyc" if "EPYC" in saved["cpu"] else "cpu"
    day = datetime.date.today().isoformat()
    out = Path(__file__).resolve().parent / "reports" / f"moe-run_{cpu}{saved['cores']}c_{day}.md"
    lines = [
        "# MoE overlapped pairs run: emulated passes, real gloo all-to-all (PP2 x EP2)", "",
        "| | |", "|---|---|",
        f"| bench | `PYTHONPATH=. python bench/moe_run.py -m {doc['m']} --iters {doc['iters']} --warmup {doc['warmup']} "
        f"--payload-kib {doc['payload_kib']}` ({doc['seconds']:.0f} s) |",
        f"| machine | {saved['cpu']}, {saved['cores']} cores, torch {saved['torch']} |",
        f"| load average | {' / '.join(f'{x:.2f}' for x in saved['load_average'])} (when saved) |",
        f"| commit measured | `{saved['commit']}` |", f"| date | {saved['date']} |",
        "| data | [bench/results/moe_run.json](../results/moe_run.json) |", "",
        f"Per stage compute F {COMPUTE['f']}, B {COMPUTE['b']}, W {COMPUTE['w']} ms (half per piece of a V), slept "
        "holding the process's one device; the all-to-all is real (dispatch and combine in F, their mirrors in B, "
        f"{doc['payload_kib']} KiB per rank each way). a_f / a_b: calibrated per stage (stage 0 shown), the expert "
        "peers' smaller. Predicted: the simulator's makespan on the calibrated profile. Measured: median iteration, barrier "
        "to barrier.", "",
        "On passes: the same schedule measured with a 1 KiB all-to-all, plus what the calibrated all-to-all adds to "
        "the simulated makespan (this takes out the runtime's own time per pass, which the emulated profile does not "
        "hold).", "",
        "| schedule | pairs | a_f / a_b stage 0 (ms) | predicted (ms) | pairs priced | on passes (ms) | measured (ms) "
        "| measured vs predicted | measured vs on passes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['kind']} | {r['pairs']} | {r['a_f'][0]:.1f} / {r['a_b'][0]:.1f} | {r['predicted_ms']:.1f} | "
                     f"{'yes' if r['pairs_priced'] else 'no' if r['pairs'] else '-'} | {r['on_passes_ms']:.1f} | "
                     f"{r['measured_ms']:.1f} | {r['vs_predicted']:+.1%} | {r['vs_on_passes']:+.1%} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
