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

on one layer per stage, first (embedding + layer), middle (layer) and last stage (layer + norm +
head + loss), one CPU thread, at several hidden sizes, of these models (``--models``):

  gpt     the built-in GPT (``zbsearch.models.gpt``)
  llama   the built-in Llama-style decoder (``zbsearch.models.llama``: RMSNorm, rotary, SwiGLU)
  moe     a Hugging Face Qwen2-MoE decoder (random weights, ``zbsearch.models.hf``): 8 routed
          experts of width ``hidden``, top-2 routing (the experts' outputs summed with
          ``index_add_``), a shared expert of width 2 x ``hidden``; cut by ``hf_stages``, whose
          boundaries carry (hidden, attention mask); needs transformers
  vit     the built-in ViT (``zbsearch.models.vit``): patch embedding (8 x 8 patches, as many as
          fit in ``--seq`` tokens with the class token), encoder blocks, classifier head

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

Targets (set on the GPT and Llama-style stages, judged on every model run): zb/plain <=
torch/plain at every size and <= 1.05 from hidden 256 up, and the first stage no worse than the
others. Prints a table and saves bench/results/split.json.

Run: python bench/split.py [--models gpt llama moe vit] [--hidden 64 128 256 512 1024] [--seq 128] [-b 1] [-m 4]
     [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS, save
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)

from zbsearch.models import (
    GPTConfig,
    ViTConfig,
    gpt_batch,
    gpt_loss,
    gpt_stages,
    image_batch,
    image_loss,
    llama_stages,
    vit_stages,
)
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
MODELS = ("gpt", "llama", "moe", "vit")


def _model(model: str, hidden: int, seq: int, batch: int) -> tuple[list, tuple, Callable, dict]:
    """Three stages of one layer each, stage 0's inputs, the loss on the last stage's output,
    and what was built (saved with the results)."""
    heads = max(2, hidden // 64)
    if model in ("gpt", "llama"):
        cfg = GPTConfig(layers=3, hidden=hidden, heads=heads, seq=seq, vocab=512, microbatch_size=batch, stages=3)
        ids, targets = gpt_batch(cfg)
        return ((gpt_stages if model == "gpt" else llama_stages)(cfg), (ids,), lambda o: gpt_loss(o, targets),
                {"heads": heads, "tokens": seq, "vocab": 512})
    if model == "vit":
        patch = 8
        image = patch * math.isqrt(seq - 1)  # (image / patch)^2 patches and the class token: at most seq tokens
        vcfg = ViTConfig(image=image, patch=patch, hidden=hidden, heads=heads, layers=3, classes=10,
                         microbatch_size=batch, stages=3)
        images, labels = image_batch(image, vcfg.channels, vcfg.classes, batch, 1)
        return (vit_stages(vcfg), (images,), lambda o: image_loss(o, labels),
                {"heads": heads, "tokens": (image // patch) ** 2 + 1, "image": image, "patch": patch, "classes": 10})
    if model == "moe":
        from zbsearch.models.hf import hf_batch, hf_loss, hf_model, hf_stages, tiny_config

        experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
                   "shared_expert_intermediate_size": 2 * hidden}
        hcfg = tiny_config("qwen2_moe", layers=3, hidden_size=hidden, num_attention_heads=heads,
                           num_key_value_heads=heads, head_dim=hidden // heads, vocab_size=512,
                           max_position_embeddings=seq, **experts)
        (ids, mask), labels = hf_batch(hcfg, batch, seq, 1)
        return (hf_stages(hf_model(hcfg), 3).stages, (ids, mask), lambda o: hf_loss(o, labels),
                {"hf_model_type": "qwen2_moe", "heads": heads, "tokens": seq, "vocab": 512, **experts})
    raise ValueError(f"unknown model {model!r}")


def _stage_input(stages, s: int, inputs: tuple) -> tuple:
    x = inputs
    with torch.no_grad():
        for st in stages[:s]:
            x = st(*x)
            x = x if isinstance(x, tuple) else (x,)
    return x


def _backward(
    variant: str, stage, xs: tuple, post, meter: ActivationMeter, deferred_first: bool = False, first: bool = False,
) -> tuple[float, float]:
    """One forward (untimed) and one backward of ``variant``: seconds of the backward, wall
    clock and this thread's CPU time (with one torch thread all compute is on this thread, so
    CPU time does not count waiting for a core on a busy machine). Floating-point inputs of a
    stage other than the first need a gradient, as in a pipeline."""
    inp = [t.detach().requires_grad_(not first and t.is_floating_point()) for t in xs]
    if variant in ("plain", "torch"):
        out = stage(*inp)
        if post is not None:
            outs, grads = [post(out)], None
        else:
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            grads = [torch.ones_like(o) for o in outs]
        needs = [t for t in inp if t.requires_grad]
        t0, c0 = time.perf_counter(), time.thread_time()
        if variant == "plain" or not needs:  # torch's runtime: a first stage's whole backward in W
            torch.autograd.backward(outs, grads)
        else:
            _, groups = stage_backward_input(outs, grads, needs, iter(stage.parameters()))
            stage_backward_weight(iter(stage.parameters()), groups)
            del groups
        del out, outs  # the pass's graph dies in the timed region, as zbsearch's W drops its pass (see the docstring)
        return time.perf_counter() - t0, time.thread_time() - c0
    # metered, as in the runtime
    fp = forward_pass(stage, inp, split=variant == "zb", post=post, meter=meter, deferred_first=deferred_first)
    grads = [torch.ones_like(o) if o.requires_grad else None for o in fp.outputs]
    t0, c0 = time.perf_counter(), time.thread_time()
    if variant == "zb":
        _, w = backward_input(fp, grads)
        backward_weight(w)
    else:
        backward_full(fp, grads)
    return time.perf_counter() - t0, time.thread_time() - c0


def measure(model: str, hidden: int, seq: int, batch: int, m: int, warmup: int, steps: int) -> tuple[dict, dict]:
    """Per stage (first, middle, last), the variants' backward times (``_summary``); and what
    was built."""
    stages, inputs, loss, built = _model(model, hidden, seq, batch)
    out = {}
    for s, where in enumerate(("first", "middle", "last")):
        x = _stage_input(stages, s, inputs)
        post = loss if s == 2 else None
        own = {v: copy.deepcopy(stages[s]) for v in VARIANTS}  # each variant accumulates its own .grad
        meter = ActivationMeter()
        # how a first stage's W runs: as the profiler would choose for this stage (a copy of it);
        # other stages have no choice to make
        inp = tuple(t.detach().requires_grad_(s > 0 and t.is_floating_point()) for t in x)
        chosen = (measure_stage(copy.deepcopy(stages[s]), inp, post, torch.device("cpu"), warmup=2, repeat=10)
                  if backward_in_w(stages[s], inp) else None)
        deferred = chosen is not None and chosen.deferred_first
        # samples[clock][v]: per step, the m microbatches' backward times (the first one creates .grad)
        samples: dict[str, dict[str, list[list[float]]]] = {c: {v: [] for v in VARIANTS} for c in CLOCKS}
        for step in range(warmup + steps):
            for v in VARIANTS:
                own[v].zero_grad(set_to_none=True)
            times = {c: {v: [] for v in VARIANTS} for c in CLOCKS}
            for k in range(m):
                for v in _rotated(step * m + k):
                    w, c = _backward(v, own[v], x, post, meter, deferred, first=s == 0)
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
    return out, built


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


def _targets(rows: list[dict], clock: str, hiddens: list[int], models: list[str]) -> dict[str, str]:
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
        "first stage no worse (2%)": verdict(all(first_ok(m, h) for m in models for h in hiddens)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=["gpt", "llama"],
                    help="models whose stages are measured (moe needs transformers)")
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
    built: dict[str, dict[int, dict]] = {}
    print(f"{'':20} {'wall clock':^44}  {'CPU time of the thread':^44}")
    print(f"{'model hidden stage':20} " + f"{'plain ms':>9} {'zb':>7} {'torch':>7} {'fused':>7} {'zb/tor':>7}  " * 2 + "load")
    for hidden in args.hidden:
        for model in args.models:
            res, built.setdefault(model, {})[hidden] = measure(model, hidden, args.seq, args.batch, args.microbatches,
                                                               args.warmup, args.steps)
            load = os.getloadavg()[0]
            for where, r in res.items():
                rows.append({"model": model, "hidden": hidden, "stage": where, **r, "load_1min": load})
                cols = "".join(f"{r[c]['step_ms']['plain'] / args.microbatches:9.2f} {r[c]['ratio']['zb']:7.3f} "
                               f"{r[c]['ratio']['torch']:7.3f} {r[c]['ratio']['fused']:7.3f} {r[c]['zb_over_torch']:7.3f}  "
                               for c in CLOCKS)
                way = ("  W deferred" if r["first_stage_w"]["deferred"] else "  W plain") if "first_stage_w" in r else ""
                print(f"{model:6} {hidden:5} {where:7} {cols}{load:.2f}{way}")
    meets = {clock: _targets(rows, clock, args.hidden, args.models) for clock in CLOCKS}
    for clock, m in meets.items():
        print(f"targets ({clock}): " + ", ".join(f"{k}: {v}" for k, v in m.items()))
    result = {
        "what": "backward time per step of m microbatches (.grad created by the first, added to by the others), "
                "median over steps; ratios to plain loss.backward() of the same stage in the same step, median over steps",
        "models": args.models, "built": built,
        "threads": args.threads, "seq": args.seq, "batch": args.batch, "microbatches": args.microbatches,
        "steps": args.steps, "load_before": load_before, "load_after": os.getloadavg(), "targets": meets, "rows": rows,
    }
    save(result, path=args.output)


if __name__ == "__main__":
    main()
