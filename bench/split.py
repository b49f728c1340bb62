"""Cost of splitting the backward: B + W against one plain ``loss.backward()``, per step.

Four backward passes of the same stage on the same microbatch, side by side, round-robin within
each microbatch so that load on a shared machine hits all four alike:

  plain   forward, then ``torch.autograd.backward`` (what a training loop without a pipeline runs)
  torch   torch.distributed.pipelining's ``stage_backward_input`` then ``stage_backward_weight``
          (on a first stage torch's runtime skips B and runs one plain backward as W: so here)
  zb      zbsearch's ``backward_input`` then ``backward_weight`` (what ZB schedules run; on a
          first stage its W runs the whole backward, plain or deferred as the profiler chose:
          ``measure_stage`` is run on the stage first, as ``zbsearch profile`` would)
  fused   zbsearch's ``backward_full`` (BW, what 1F1B runs)

on the built-in GPT (``zbsearch.models.gpt``) and the Llama-style model (``zbsearch.models.llama``:
RMSNorm, rotary, SwiGLU), one layer per stage, first (embedding + layer), middle (layer) and
last stage (layer + norm + head + loss), one CPU thread, at several hidden sizes.

Each variant has its own copy of the stage and runs steps as a pipeline rank does: ``.grad``
set to None, then m microbatches whose gradients accumulate (the first creates ``.grad``, the
others add to it). zbsearch's passes are metered (an ``ActivationMeter``) as in the runtime.
The variants take turns in the round-robin's places (each starts a microbatch in turn): in a
fixed order, plain and torch, which on a first stage run the same code, measured 1% apart.
Only the backward is timed (the forward is untimed), and with it the release of the pass's
graph for every variant (zbsearch's W drops its pass, so plain and torch drop theirs before
the clock stops rather than after; destroying the graph's nodes is some 10 us at hidden 64,
a cost every training step pays somewhere). Times are wall clock and the thread's CPU time
(on a busy machine wall clock includes waiting for a core; CPU time does not). A ratio is a
variant's backward time over ``plain``'s in the same step, median over steps; also given apart
for the first microbatch of a step and for the accumulating ones; ``zb/tor`` is zb's time over
torch's in the same step, median over steps (what "zb <= torch" is judged on: on a busy machine
two ratios to plain taken apart differ by 1-2% from noise alone), with a 95% bootstrap interval
of that median: where zb's median is above torch's but the interval reaches 1, the verdict is
"within noise", neither met nor missed. zbsearch's first microbatch
of a stage checks the graph before taking its fast path: it is in the warm-up. Load average is
recorded.

Targets (issue 12): zb/plain <= torch/plain at every size and <= 1.05 from hidden 256 up, and the
first stage no worse than the others. Prints a table and saves bench/results/split.json.

Run: python bench/split.py [--hidden 64 128 256 512 1024] [--seq 128] [-b 1] [-m 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
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
from zbsearch.profiler import measure_stage
from zbsearch.runtime import (
    backward_full,
    backward_input,
    backward_weight,
    forward_pass,
)
from zbsearch.runtime.memory import ActivationMeter
from zbsearch.runtime.split import backward_in_w

VARIANTS = ("plain", "torch", "zb", "fused")
CLOCKS = ("wall", "cpu")


def _stage_input(stages, s: int, ids: torch.Tensor) -> torch.Tensor:
    x = ids
    with torch.no_grad():
        for st in stages[:s]:
            x = st(x)
    return x


def _backward(
    variant: str, stage, x: torch.Tensor, post, meter: ActivationMeter, deferred_first: bool = False,
) -> tuple[float, float]:
    """One forward (untimed) and one backward of ``variant``: seconds of the backward, wall
    clock and this thread's CPU time (with one torch thread all compute is on this thread, so
    CPU time does not count waiting for a core on a busy machine)."""
    inp = x.detach().requires_grad_(x.is_floating_point())
    if variant in ("plain", "torch"):
        out = stage(inp)
        out = post(out) if post is not None else out
        grad = torch.ones_like(out) if post is None else None
        t0, c0 = time.perf_counter(), time.thread_time()
        if variant == "plain" or not inp.requires_grad:  # torch's runtime: a first stage's whole backward in W
            torch.autograd.backward(out, grad)
        else:
            _, groups = stage_backward_input([out], None if grad is None else [grad], [inp], iter(stage.parameters()))
            stage_backward_weight(iter(stage.parameters()), groups)
            del groups
        del out  # the pass's graph dies in the timed region, as zbsearch's W drops its pass (see the docstring)
        return time.perf_counter() - t0, time.thread_time() - c0
    # metered, as in the runtime
    fp = forward_pass(stage, [inp], split=variant == "zb", post=post, meter=meter, deferred_first=deferred_first)
    grads = [torch.ones_like(fp.outputs[0])]
    t0, c0 = time.perf_counter(), time.thread_time()
    if variant == "zb":
        _, w = backward_input(fp, grads)
        backward_weight(w)
    else:
        backward_full(fp, grads)
    return time.perf_counter() - t0, time.thread_time() - c0


def measure(model: str, hidden: int, seq: int, batch: int, m: int, warmup: int, steps: int) -> dict:
    heads = max(2, hidden // 64)
    cfg = GPTConfig(layers=3, hidden=hidden, heads=heads, seq=seq, vocab=512, microbatch_size=batch, stages=3)
    stages = (gpt_stages if model == "gpt" else llama_stages)(cfg)
    ids, targets = gpt_batch(cfg)
    out = {}
    for s, where in enumerate(("first", "middle", "last")):
        x = _stage_input(stages, s, ids)
        post = (lambda o: gpt_loss(o, targets)) if s == 2 else None
        own = {v: copy.deepcopy(stages[s]) for v in VARIANTS}  # each variant accumulates its own .grad
        meter = ActivationMeter()
        # how a first stage's W runs: as the profiler would choose for this stage (a copy of it);
        # other stages have no choice to make
        inp = x.detach().requires_grad_(x.is_floating_point())
        chosen = (measure_stage(copy.deepcopy(stages[s]), (inp,), post, torch.device("cpu"), warmup=2, repeat=10)
                  if backward_in_w(stages[s], (inp,)) else None)
        deferred = chosen is not None and chosen.deferred_first
        # samples[clock][v]: per step, the m microbatches' backward times (the first one creates .grad)
        samples: dict[str, dict[str, list[list[float]]]] = {c: {v: [] for v in VARIANTS} for c in CLOCKS}
        for step in range(warmup + steps):
            for v in VARIANTS:
                own[v].zero_grad(set_to_none=True)
            times = {c: {v: [] for v in VARIANTS} for c in CLOCKS}
            for k in range(m):
                for v in _rotated(step * m + k):
                    w, c = _backward(v, own[v], x, post, meter, deferred)
                    times["wall"][v].append(w * 1e3)
                    times["cpu"][v].append(c * 1e3)
            if step >= warmup:
                for c in CLOCKS:
                    for v in VARIANTS:
                        samples[c][v].append(times[c][v])
        out[where] = {c: _summary(samples[c]) for c in CLOCKS}
        if chosen is not None and chosen.not_taken is not None:
            out[where]["first_stage_w"] = {
                "deferred": deferred,
                "profiled_ms": {("deferred" if deferred else "plain"): chosen.w.mean,
                                ("plain" if deferred else "deferred"): chosen.not_taken[2].mean},
            }
    return out


def _rotated(k: int) -> tuple[str, ...]:
    """The variants in round-robin order, starting at the ``k``-th: each takes every place in
    turn (a fixed order measured plain and torch, the same code on a first stage, 1% apart)."""
    k %= len(VARIANTS)
    return VARIANTS[k:] + VARIANTS[:k]


def _summary(samples: dict[str, list[list[float]]]) -> dict:
    """Medians over steps: of each variant's backward time per step (ms) and of its ratio to
    ``plain`` in the same step; the ratio also for the first microbatch of a step alone (which
    creates ``.grad``) and for the others (which add to it); and zb's ratio to torch in the same
    step, which the target compares (two ratios to plain taken apart add plain's noise twice)."""

    def ratios(v: str, pick, to: str = "plain") -> list[float]:
        return [pick(a) / pick(b) for a, b in zip(samples[v], samples[to])]

    def spread(xs: list[float]) -> float:
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / 2 / statistics.median(xs)

    others = [v for v in VARIANTS if v != "plain"]
    step = {v: [sum(t) for t in samples[v]] for v in VARIANTS}
    return {
        "step_ms": {v: statistics.median(xs) for v, xs in step.items()},
        "spread": {v: spread(xs) for v, xs in step.items()},
        "ratio": {v: statistics.median(ratios(v, sum)) for v in others},
        "ratio_spread": {v: spread(ratios(v, sum)) for v in others},
        "ratio_first_microbatch": {v: statistics.median(ratios(v, lambda t: t[0])) for v in others},
        "ratio_accumulating": {v: statistics.median(ratios(v, lambda t: sum(t[1:]))) for v in others},
        "zb_over_torch": statistics.median(ratios("zb", sum, "torch")),
        "zb_over_torch_spread": spread(ratios("zb", sum, "torch")),
        "zb_over_torch_95": _median_interval(ratios("zb", sum, "torch")),
    }


def _median_interval(xs: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median (steps resampled, a fixed seed): how far the
    median of this many steps can move from noise alone."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def _versus_torch(rows: list[dict], clock: str) -> str:
    """"met" when zb's median step is at most torch's everywhere; where it is above, "within
    noise" if the median's 95% interval reaches 1 (on a first stage both run one plain backward,
    and a step's spread is 2-4%), else "MISSED"."""
    above = [r[clock]["zb_over_torch_95"] for r in rows if r[clock]["zb_over_torch"] > 1]
    if not above:
        return "met"
    return "within noise" if all(lo <= 1 for lo, _ in above) else "MISSED"


def _targets(rows: list[dict], clock: str, hiddens: list[int]) -> dict[str, str]:
    def zb(r):
        return r[clock]["ratio"]["zb"]

    def first_ok(model, h):
        mine = [r for r in rows if r["model"] == model and r["hidden"] == h]
        first = next(r for r in mine if r["stage"] == "first")
        return zb(first) <= 1.02 * max(zb(r) for r in mine if r["stage"] != "first")

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return {
        "zb <= torch everywhere": _versus_torch(rows, clock),
        "zb <= 1.05 from hidden 256": verdict(all(zb(r) <= 1.05 for r in rows if r["hidden"] >= 256)),
        "first stage no worse (2%)": verdict(all(first_ok(m, h) for m in ("gpt", "llama") for h in hiddens)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("-b", "--batch", type=int, default=1)
    ap.add_argument("-m", "--microbatches", type=int, default=4, help="per step (at least 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-o", "--output", type=Path, default=RESULTS / "split.json")
    args = ap.parse_args()
    if args.microbatches < 2 or args.steps < 2:
        ap.error("need at least 2 microbatches per step and 2 steps")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    print(f"{'':20} {'wall clock':^44}  {'CPU time of the thread':^44}")
    print(f"{'model hidden stage':20} " + f"{'plain ms':>9} {'zb':>7} {'torch':>7} {'fused':>7} {'zb/tor':>7}  " * 2 + "load")
    for hidden in args.hidden:
        for model in ("gpt", "llama"):
            res = measure(model, hidden, args.seq, args.batch, args.microbatches, args.warmup, args.steps)
            load = os.getloadavg()[0]
            for where, r in res.items():
                rows.append({"model": model, "hidden": hidden, "stage": where, **r, "load_1min": load})
                cols = "".join(f"{r[c]['step_ms']['plain'] / args.microbatches:9.2f} {r[c]['ratio']['zb']:7.3f} "
                               f"{r[c]['ratio']['torch']:7.3f} {r[c]['ratio']['fused']:7.3f} {r[c]['zb_over_torch']:7.3f}  "
                               for c in CLOCKS)
                way = ("  W deferred" if r["first_stage_w"]["deferred"] else "  W plain") if "first_stage_w" in r else ""
                print(f"{model:6} {hidden:5} {where:7} {cols}{load:.2f}{way}")
    meets = {clock: _targets(rows, clock, args.hidden) for clock in CLOCKS}
    for clock, m in meets.items():
        print(f"targets ({clock}): " + ", ".join(f"{k}: {v}" for k, v in m.items()))
    result = {
        "what": "backward time per step of m microbatches (.grad created by the first, added to by the others), "
                "median over steps; ratios to plain loss.backward() of the same stage in the same step, median over steps",
        "threads": args.threads, "seq": args.seq, "batch": args.batch, "microbatches": args.microbatches,
        "steps": args.steps, "load_before": load_before, "load_after": os.getloadavg(), "targets": meets, "rows": rows,
    }
    save(result, path=args.output)


if __name__ == "__main__":
    main()
