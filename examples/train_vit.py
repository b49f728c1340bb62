"""Train the built-in ViT (or the ResNet-style conv stack) with a zbsearch schedule, one process per rank.

    zbsearch schedule zb-v -p examples/uniform-p2.json -m 8 -o zbv.json      # any schedule for p ranks
    torchrun --nproc-per-node 2 examples/train_vit.py zbv.json --steps 30 --check
    torchrun --nproc-per-node 2 examples/train_vit.py zbv.json --model resnet
    torchrun --nproc-per-node 4 examples/train_vit.py zbv.json --dp 2 --check   # two replicas

gloo on CPU by default, NCCL when CUDA is present (one GPU per rank). Every rank builds the
same model from one seed and keeps only the stages the schedule places on it; the task is
synthetic (each class stamps its own pattern somewhere on noisy images), so the loss can be seen
to fall. ``--dp N``: N replicas of the pipeline, each on its share of the global batch, the
runtime reducing the gradients across them.
``--check``: before training, every rank compares one step's gradients with the whole model's
on the global batch in one process and prints the largest difference.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zbsearch as zb
from zbsearch.distributed.mesh import mesh_for
from zbsearch.distributed.torchrun import run_under_torchrun
from zbsearch.models import ResNetConfig, ViTConfig, image_batch, image_loss, resnet_stages, vit_stages
from zbsearch.runtime import PipelineRuntime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", type=Path, help="schedule JSON (its number of ranks = processes)")
    ap.add_argument("--model", choices=["vit", "resnet"], default="vit")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatch-size", "-b", type=int, default=8, help="images per microbatch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check", action="store_true", help="compare one step's gradients with one process first")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (processes = ranks x dp)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for another rank before failing")
    args = ap.parse_args()
    for name in ("steps", "microbatch_size", "dp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    run_under_torchrun(lambda device: run(args, device))


def build(args, num_stages: int) -> list[torch.nn.Module]:
    if args.model == "vit":
        return vit_stages(ViTConfig(image=32, patch=8, hidden=64, heads=4, layers=max(4, num_stages), classes=10,
                                    microbatch_size=args.microbatch_size, stages=num_stages))
    return resnet_stages(ResNetConfig(image=32, width=16, groups=3, blocks_per_group=max(2, -(-num_stages // 3)),
                                      classes=10, microbatch_size=args.microbatch_size, stages=num_stages))


def run(args, device: torch.device) -> None:
    sched = zb.load_schedule(args.schedule)
    m, S = sched.num_microbatches, sched.num_stages
    mesh = mesh_for(sched.num_ranks, dp_replicate=args.dp)
    rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    stages = {s: st.to(device) for s, st in enumerate(build(args, S)) if sched.stage_to_rank[s] == rank}
    runtime = PipelineRuntime(sched, stages, image_loss, device=device, timeout=args.timeout, mesh=mesh)
    share = m * args.microbatch_size

    def batch(step: int):  # the global batch: every replica's share
        return image_batch(32, 3, 10, args.dp * share, seed=1000 + step)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t[replica * share:(replica + 1) * share]

    if args.check:
        check(args, runtime, stages, batch(0), m * args.dp, mine)
    optimizer = torch.optim.AdamW([p for st in stages.values() for p in st.parameters()], lr=args.lr)
    for step in range(args.steps):
        images, labels = batch(step)
        optimizer.zero_grad()
        t0 = time.perf_counter()
        losses = runtime.step(mine(images) if 0 in stages else None, mine(labels) if S - 1 in stages else None)
        optimizer.step()
        if losses is not None and replica == 0:  # its share of the global batch
            print(f"step {step:3d}  loss {losses.mean().item():.4f}  {1e3 * (time.perf_counter() - t0):7.1f} ms", flush=True)
    runtime.close()


def check(args, runtime, stages, batch, m: int, mine) -> None:
    """One step's gradients on this rank against the whole model's on the global batch (``m``
    microbatches) in this process (one thread, as each rank runs, so that weight gradients are
    summed in the same order); ``mine`` takes this replica's share."""
    images, labels = batch
    runtime.step(mine(images) if 0 in stages else None, mine(labels) if runtime.last in stages else None)
    whole = build(args, runtime.schedule.num_stages)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for x, y in zip(images.chunk(m), labels.chunk(m)):
        for st in whole:
            x = st(x)
        (image_loss(x, y) / m).backward()
    torch.set_num_threads(threads)
    worst = 0.0
    for s, st in stages.items():
        ref = dict(whole[s].named_parameters())
        for name, p in st.named_parameters():
            worst = max(worst, (p.grad.cpu() - ref[name].grad).abs().max().item())
        st.zero_grad(set_to_none=True)
    print(f"rank {dist.get_rank()}: max |grad - one process| = {worst:.3g} over stages {sorted(stages)}", flush=True)


if __name__ == "__main__":
    main()
