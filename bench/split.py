"""Cost of splitting the backward: per microbatch, B + W against one plain ``loss.backward()``.

Four backward passes of the same stage on the same microbatch, side by side, round-robin within
each repetition so that load on a shared machine hits all four alike:

  plain   forward, then ``torch.autograd.backward`` (what a training loop without a pipeline runs)
  torch   torch.distributed.pipelining's ``stage_backward_input`` then ``stage_backward_weight``
          (on a first stage torch's runtime skips B and runs one plain backward as W: so here)
  zb      zbsearch's ``backward_input`` then ``backward_weight`` (what ZB schedules run)
  fused   zbsearch's ``backward_full`` (BW, what 1F1B runs)

on the built-in GPT (``zbsearch.models.gpt``) and the Llama-style model (``zbsearch.models.llama``:
RMSNorm, rotary, SwiGLU), one layer per stage, first (embedding + layer), middle (layer) and
last stage (layer + norm + head + loss), one CPU thread, at several hidden sizes. Only the
backward is timed (the forward of each variant is untimed), median over repetitions, both wall
clock and the thread's CPU time (on a busy machine wall clock includes waiting for a core; CPU
time does not); ratios are to ``plain`` of the same stage, clock and repetitions. zbsearch's first microbatch of a stage checks
the graph before taking its fast path: it is in the warm-up. Load average is recorded.

Targets (issue 12): zb/plain <= torch/plain at every size and <= 1.05 from hidden 256 up, and the
first stage no worse than the others. Prints a table and saves bench/results/split.json.

Run: python bench/split.py [--hidden 64 128 256 512 1024] [--seq 128] [-b 1] [--repeat 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, save
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)

from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages, llama_stages
from zbsearch.runtime import (
    backward_full,
    backward_input,
    backward_weight,
    forward_pass,
)

VARIANTS = ("plain", "torch", "zb", "fused")


def _stage_input(stages, s: int, ids: torch.Tensor) -> torch.Tensor:
    x = ids
    with torch.no_grad():
        for st in stages[:s]:
            x = st(x)
    return x


def _time_backward(variant: str, stage, x: torch.Tensor, post) -> tuple[float, float]:
    """One forward (untimed) and one backward of ``variant``: seconds of the backward, wall
    clock and this thread's CPU time (with one torch thread all compute is on this thread, so
    CPU time does not count waiting for a core on a busy machine)."""
    params = [p for p in stage.parameters()]
    inp = x.detach().requires_grad_(x.is_floating_point())
    if variant in ("plain", "torch"):
        out = stage(inp)
        out = post(out) if post is not None else out
        grad = torch.ones_like(out) if post is None else None
        t0, c0 = time.perf_counter(), time.thread_time()
        if variant == "plain" or not inp.requires_grad:  # torch's runtime: a first stage's whole backward in W
            torch.autograd.backward(out, grad)
        else:
            _, groups = stage_backward_input([out], None if grad is None else [grad], [inp], iter(params))
            stage_backward_weight(iter(params), groups)
        return time.perf_counter() - t0, time.thread_time() - c0
    fp = forward_pass(stage, [inp], split=variant == "zb", post=post)
    grads = [torch.ones_like(fp.outputs[0])]
    t0, c0 = time.perf_counter(), time.thread_time()
    if variant == "zb":
        backward_input(fp, grads)
        backward_weight(fp)
    else:
        backward_full(fp, grads)
    return time.perf_counter() - t0, time.thread_time() - c0


def measure(model: str, hidden: int, seq: int, batch: int, warmup: int, repeat: int) -> dict:
    heads = max(2, hidden // 64)
    cfg = GPTConfig(layers=3, hidden=hidden, heads=heads, seq=seq, vocab=512, microbatch_size=batch, stages=3)
    stages = (gpt_stages if model == "gpt" else llama_stages)(cfg)
    ids, targets = gpt_batch(cfg)
    out = {}
    for s, where in enumerate(("first", "middle", "last")):
        x = _stage_input(stages, s, ids)
        post = (lambda o: gpt_loss(o, targets)) if s == 2 else None
        wall = {v: [] for v in VARIANTS}
        cpu = {v: [] for v in VARIANTS}
        for rep in range(warmup + repeat):
            for v in VARIANTS:
                for p in stages[s].parameters():  # each variant starts from no .grad: none pays an add
                    p.grad = None
                w, c = _time_backward(v, stages[s], x, post)
                if rep >= warmup:
                    wall[v].append(w * 1e3)
                    cpu[v].append(c * 1e3)
        out[where] = {"wall": _summary(wall), "cpu": _summary(cpu)}
    return out


def _summary(samples: dict[str, list[float]]) -> dict:
    med = {v: statistics.median(xs) for v, xs in samples.items()}
    quart = {v: statistics.quantiles(xs, n=4) for v, xs in samples.items()}
    return {
        "ms": med,
        "spread": {v: (q[2] - q[0]) / 2 / med[v] for v, q in quart.items()},
        "ratio": {v: med[v] / med["plain"] for v in samples if v != "plain"},
    }


def _targets(rows: list[dict], clock: str, hiddens: list[int]) -> dict[str, bool]:
    def zb(r):
        return r[clock]["ratio"]["zb"]

    def first_ok(model, h):
        mine = [r for r in rows if r["model"] == model and r["hidden"] == h]
        first = next(r for r in mine if r["stage"] == "first")
        return zb(first) <= 1.02 * max(zb(r) for r in mine if r["stage"] != "first")

    return {
        "zb <= torch everywhere": all(zb(r) <= r[clock]["ratio"]["torch"] for r in rows),
        "zb <= 1.05 from hidden 256": all(zb(r) <= 1.05 for r in rows if r["hidden"] >= 256),
        "first stage no worse (2%)": all(first_ok(m, h) for m in ("gpt", "llama") for h in hiddens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("-b", "--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-o", "--output", type=Path, default=RESULTS / "split.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    print(f"{'':20} {'wall clock':^40}  {'CPU time of the thread':^40}")
    print(f"{'model hidden stage':20} " + f"{'plain ms':>9} {'zb':>7} {'torch':>7} {'fused':>7}      " * 2 + "load")
    for hidden in args.hidden:
        for model in ("gpt", "llama"):
            res = measure(model, hidden, args.seq, args.batch, args.warmup, args.repeat)
            load = os.getloadavg()[0]
            for where, r in res.items():
                rows.append({"model": model, "hidden": hidden, "stage": where, **r, "load_1min": load})
                cols = "".join(f"{r[c]['ms']['plain']:9.2f} {r[c]['ratio']['zb']:7.3f} {r[c]['ratio']['torch']:7.3f} "
                               f"{r[c]['ratio']['fused']:7.3f}      " for c in ("wall", "cpu"))
                print(f"{model:6} {hidden:5} {where:7} {cols}{load:.2f}")
    meets = {clock: _targets(rows, clock, args.hidden) for clock in ("wall", "cpu")}
    for clock, m in meets.items():
        print(f"targets ({clock}): " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in m.items()))
    result = {
        "what": "per-microbatch backward time, median; ratios to plain loss.backward() of the same stage",
        "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "torch": torch.__version__, "seq": args.seq, "batch": args.batch, "repeat": args.repeat,
        "load_before": load_before, "load_after": os.getloadavg(), "targets": meets, "rows": rows,
    }
    save(result, path=args.output)


if __name__ == "__main__":
    main()
