"""Train the built-in GPT (``zbsearch.models``) with a zbsearch schedule, one process per rank.

    zbsearch schedule zb-h1 -p examples/uniform-p2.json -m 8 -o zbh1.json   # any schedule for p ranks
    torchrun --nproc-per-node 2 examples/train_gpt.py zbh1.json --steps 20 --trace trace.json
    zbsearch show zbh1.json --measured trace.json

gloo on CPU by default, NCCL when CUDA is present (one GPU per rank). Every rank builds the
same model from one seed and keeps only the stages the schedule places on it. The rank
holding the last stage prints the loss per step; rank 0 writes the last step's trace.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zbsearch as zb
from zbsearch.distributed.torchrun import run_under_torchrun
from zbsearch.formats.trace import save_trace
from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
from zbsearch.runtime import PipelineRuntime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", type=Path, help="schedule JSON (its number of ranks = processes)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--microbatch-size", "-b", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default: 2 per stage)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for another rank before failing")
    ap.add_argument("--trace", type=Path, default=None, help="write the last step's Chrome trace here (rank 0)")
    args = ap.parse_args()

    run_under_torchrun(lambda device: run(args, device))


def run(args, device: torch.device) -> None:
    rank = dist.get_rank()
    sched = zb.load_schedule(args.schedule)
    m, S = sched.num_microbatches, sched.num_stages
    cfg = GPTConfig(layers=args.layers or 2 * S, hidden=args.hidden, heads=4, seq=32, vocab=64,
                    microbatch_size=args.microbatch_size, stages=S)
    stages = {s: st.to(device) for s, st in enumerate(gpt_stages(cfg)) if sched.stage_to_rank[s] == rank}
    runtime = PipelineRuntime(sched, stages, gpt_loss, device=device, timeout=args.timeout)
    params = [p for st in stages.values() for p in st.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    for step in range(args.steps):
        inputs, targets = gpt_batch(cfg, m, seed=step)  # a new batch every step
        optimizer.zero_grad()
        t0 = time.perf_counter()
        losses = runtime.step(inputs if 0 in stages else None, targets if S - 1 in stages else None)
        optimizer.step()
        if losses is not None:
            print(f"step {step:3d}  loss {losses.mean().item():.4f}  {1e3 * (time.perf_counter() - t0):7.1f} ms", flush=True)
    trace = runtime.trace()
    if trace is not None and args.trace is not None:
        save_trace(trace, args.trace)
        print(f"wrote {args.trace}", flush=True)


if __name__ == "__main__":
    main()
