"""One CUDA GPU: the profile against the runtime's passes, and a step against its prediction.

One GPU cannot hold a pipeline of several ranks (NCCL refuses two ranks on one device), so this
checks what one GPU can:

  profile   the built-in GPT profiled on the GPU, one device, stage after stage: F, B, W and
            their ratios (the paper's GPUs give T_B close to T_F and T_W below it), activation
            memory per microbatch
  one rank  the model in two stages that one rank holds as a V (ZB-V, and the solver's schedule
            at ZB-V's memory), replayed by the runtime on the GPU: each pass's time against the
            profile (``runtime_vs_profile``), the step against the profile's prediction, and the
            activations the CUDA allocator held at the step's peak against the predicted peak

Profile and replays alternate over ``--rounds``; the medians are kept. Also runs on the CPU
(``--device cpu``) to check the script itself. Saves bench/results/gpu.json.

Run: python bench/gpu.py [--layers 16 --hidden 2048 --heads 16 --seq 1024 -b 4] [--dtype bfloat16] [-m 8]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from common import save

import zbsearch as zb
from zbsearch.models import GPTConfig, gpt_batch
from zbsearch.profiler import Settings, builtin_gpt, profile_one_device, runtime_vs_profile
from zbsearch.runtime import PipelineRuntime

MIB = 2**20


def _replay(spec, sched: zb.Schedule, device: torch.device, cfg: GPTConfig, m: int, steps: int) -> dict:
    """Steps of one schedule on this process's device: step times, traces and the allocator's
    peak above what the step started with (parameters, gradients and inputs)."""
    ids, targets = gpt_batch(cfg, m, seed=2)
    cuda = device.type == "cuda"
    spans, traces, peaks = [], [], []
    with PipelineRuntime(sched, dict(enumerate(spec.stages)), spec.loss_fn, device=device) as runtime:
        for step in range(steps + 1):  # the first step warms up (and allocates the gradients)
            for st in spec.stages:
                st.zero_grad(set_to_none=False)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            runtime.step(ids, targets)
            if cuda:
                torch.cuda.synchronize(device)
                peaks.append((torch.cuda.max_memory_allocated(device) - base) / MIB)
            trace = runtime.trace()
            if step and trace is not None:
                spans.append(max(trace.span_ms()))
                traces.append(trace)
    return {"step_ms": statistics.median(spans), "traces": traces,
            "allocator_peak_mib": statistics.median(peaks[1:]) if peaks else None,
            "runtime_peak_mib": max(e.args.activations or 0.0 for e in traces[-1].traceEvents) / MIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("-b", "--microbatch-size", type=int, default=4)
    ap.add_argument("-m", "--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds for the solver's schedule")
    args = ap.parse_args()
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                    microbatch_size=args.microbatch_size, stages=2)
    spec = builtin_gpt(cfg)
    settings = Settings(device=args.device, dtype=args.dtype, rounds=1)
    load = [os.getloadavg()[0]]
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rounds: list[dict] = []
    try:
        for _ in range(args.rounds):
            prof = profile_one_device(spec, settings, placement=[0, 0], name="gpt-v-one-rank")
            device = next(spec.stages[0].parameters()).device
            zbv = zb.build_classic("zb-v", prof, args.microbatches)
            assert zbv.predicted is not None  # built schedules carry their prediction
            solved = zb.solve(prof, args.microbatches, [max(zbv.predicted.peak_memory)], chunks=2, time_limit=args.time_limit,
                              deterministic=True).schedule
            got = {}
            for name, sched in (("zb-v", zbv), ("solved", solved)):
                run = _replay(spec, sched, device, cfg, args.microbatches, args.steps)
                assert sched.predicted is not None
                peak = max(sched.predicted.peak_memory) / MIB if prof.memory_unit == "bytes" else None
                got[name] = {"kind": sched.kind, "predicted_ms": max(sched.predicted.span), "measured_ms": run["step_ms"],
                             "predicted_peak_mib": peak,
                             "allocator_peak_mib": run["allocator_peak_mib"], "runtime_peak_mib": run["runtime_peak_mib"],
                             "passes": [{"stage": a.stage, "op": a.op.value, "profiled_ms": a.profiled, "measured_ms": a.measured}
                                        for a in runtime_vs_profile(prof, run["traces"])]}
            rounds.append({"profile": prof.model_dump(), "schedules": got})
            load.append(os.getloadavg()[0])
    finally:
        dist.destroy_process_group()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"{gpu or 'CPU'}, {args.dtype}, {cfg}, m={args.microbatches}; {args.steps} steps x {args.rounds} rounds")
    for name in ("zb-v", "solved"):
        rows = [r["schedules"][name] for r in rounds]
        pred, meas = statistics.median(r["predicted_ms"] for r in rows), statistics.median(r["measured_ms"] for r in rows)
        print(f"{name:>7} ({rows[0]['kind']}): predicted {pred:.1f} ms, measured {meas:.1f} ms ({meas / pred - 1:+.1%}); "
              f"peak activations predicted {rows[-1]['predicted_peak_mib']} MiB, allocator {rows[-1]['allocator_peak_mib']} MiB")
    stages = rounds[-1]["profile"]["stages"]
    for s, st in enumerate(stages):
        print(f"stage {s}: F {st['t_f']:.2f} B {st['t_b']:.2f} W {st['t_w']:.2f} ms; B/F {st['t_b'] / st['t_f']:.2f} "
              f"W/F {st['t_w'] / st['t_f']:.2f}")
    save({"model": vars(args), "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
          "load_average": load, "rounds": rounds}, "gpu")


if __name__ == "__main__":
    main()
