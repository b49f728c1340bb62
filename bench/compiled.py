"""torch.compile under the split backward: a compiled stage's passes against the eager stage's.

One process, one GPT stage (the built-in model's middle stage: transformer layers, no embedding
or head), one microbatch at a time through the runtime's pass functions, as a pipeline rank runs
them. Per variant, round robin after warm-up, medians:
  eager split      F, B (input gradient), W (weight gradient): what a zero-bubble rank runs
  eager fused      F, BW (one backward)
  compiled split   the stage under torch.compile: F, B (the whole backward: a compiled region
                   cannot split), W (nothing left)
  compiled fused   the stage under torch.compile: F, BW
Target: a compiled split stage at least as fast as the eager one (F + B + W).

Saves bench/results/compiled.json.
Run: PYTHONPATH=. python bench/compiled.py [--hidden 256] [--seq 128] [--mb 4] [--layers 2] [--reps 30]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from common import save

from zbsearch.models import GPTConfig, gpt_stages
from zbsearch.runtime import backward_full, backward_input, backward_weight, forward_pass


def timed(stage: torch.nn.Module, x: torch.Tensor, split: bool) -> dict[str, float]:
    """One microbatch's passes on ``stage`` (ms each)."""
    out = {}
    t0 = time.perf_counter()
    fp = forward_pass(stage, (x.detach().requires_grad_(),), split=split)
    t1 = time.perf_counter()
    g = [torch.ones_like(fp.outputs[0])]
    if split:
        _, w = backward_input(fp, g)
        t2 = time.perf_counter()
        backward_weight(w)
        t3 = time.perf_counter()
        out = {"F": t1 - t0, "B": t2 - t1, "W": t3 - t2}
    else:
        backward_full(fp, g)
        t2 = time.perf_counter()
        out = {"F": t1 - t0, "BW": t2 - t1}
    stage.zero_grad(set_to_none=True)
    return {k: v * 1e3 for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2, help="transformer layers in the stage")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("-o", "--output", default="compiled")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(layers=3 * args.layers, hidden=args.hidden, heads=max(1, args.hidden // 64), seq=args.seq,
                    vocab=256, microbatch_size=args.mb, stages=3)
    eager = gpt_stages(cfg)[1]
    compiled = torch.compile(copy.deepcopy(eager), backend=args.backend)
    x = torch.randn(args.mb, args.seq, args.hidden)
    variants = {"eager split": (eager, True), "eager fused": (eager, False),
                "compiled split": (compiled, True), "compiled fused": (compiled, False)}
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    for rep in range(args.warmup + args.reps):
        for name, (stage, split) in variants.items():
            r = timed(stage, x, split)
            if rep >= args.warmup:
                runs[name].append(r)
    rows = {}
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        total = statistics.median(sum(r.values()) for r in rs)
        rows[name] = {"passes_ms": med, "total_ms": total, "runs_ms": rs}
        print(f"{name:16} " + "  ".join(f"{k} {v:7.2f}" for k, v in med.items()) + f"   total {total:7.2f} ms")
    ratio = rows["eager split"]["total_ms"] / rows["compiled split"]["total_ms"]
    print(f"compiled split vs eager split: {ratio:.2f}x")
    save({"hidden": args.hidden, "seq": args.seq, "mb": args.mb, "layers": args.layers, "backend": args.backend,
          "reps": args.reps, "warmup": args.warmup, "threads": torch.get_num_threads(), "variants": rows,
          "speedup_compiled_split": ratio, "wall_s": time.perf_counter() - t0}, args.output)


if __name__ == "__main__":
    main()
