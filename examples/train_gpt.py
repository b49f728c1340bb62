"""Train the built-in GPT (``zbsearch.models``) with a zbsearch schedule, one process per rank.

    zbsearch schedule zb-h1 -p examples/uniform-p2.json -m 8 -o zbh1.json   # any schedule for p ranks
    torchrun --nproc-per-node 2 examples/train_gpt.py zbh1.json --steps 20 --trace trace.json
    zbsearch show zbh1.json --measured trace.json

A plan from ``zbsearch plan`` or ``zbsearch tune`` carries its cut of the layers (its
``partition``), which the stages follow; ``--layers-per-stage`` gives one for any other schedule.

In a mesh, ``--dp N`` runs N replicas of the pipeline on the global batch (``--shard``: the N
data-parallel ranks shard each stage with ``fully_shard`` instead of holding it whole),
``--tp N`` splits each stage's layers over N ranks (``zbsearch.models.tensor_parallel``);
processes = ranks x dp x tp:

    torchrun --nproc-per-node 4 examples/train_gpt.py zbh1.json --dp 2 --steps 20 --check
    torchrun --nproc-per-node 4 examples/train_gpt.py zbh1.json --dp 2 --shard --check
    torchrun --nproc-per-node 8 examples/train_gpt.py zbh1.json --dp 2 --tp 2 --check
    torchrun --nproc-per-node 8 examples/train_gpt.py zbh1.json --dp 2 --shard --tp 2 --check

``--emulate`` runs the same mesh and schedule with stages that sleep the schedule's profiled
times instead of computing (``zbsearch.runtime.emulation``): the messages between stages have
the real activations' size and the gradient reductions the real stages' bytes, and the optimizer
step sleeps the profile's ``t_opt``. It measures what the schedule and the mesh take apart from
the compute, e.g. on a machine with fewer cores than processes, where real passes wait for a core:

    torchrun --nproc-per-node 4 examples/train_gpt.py tuned/schedule.json --dp 2 --steps 20 --emulate

gloo on CPU by default, NCCL when CUDA is present (one GPU per rank). Every rank builds the
same model from one seed and keeps only the stages the schedule places on it; each replica
takes its share of every global batch, and the runtime reduces each stage's gradients across
the replicas as soon as the stage's last backward pass of the step has run. The ranks holding
the last stage print the loss per step; rank 0 writes the last step's trace. ``--check``:
every step, each rank compares its gradients with the whole model's on the global batch in
one process and prints the largest difference at the end.
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
from zbsearch.formats.trace import save_trace
from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
from zbsearch.models.sharding import shard_stage
from zbsearch.models.tensor_parallel import full_tensor, parallelize_stage
from zbsearch.runtime import PipelineRuntime, emulated_loss, emulated_stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", type=Path, help="schedule JSON (its number of ranks = processes)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--microbatch-size", "-b", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the plan's, else 2 per stage)")
    ap.add_argument("--layers-per-stage", default=None,
                    help="transformer blocks of each stage, e.g. 3,3,2 (default: a plan's cut, else even)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for another rank before failing")
    ap.add_argument("--trace", type=Path, default=None, help="write the last step's Chrome trace here (rank 0, first replica)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (processes = ranks x dp)")
    ap.add_argument("--shard", action="store_true", help="shard each stage over the --dp ranks (fully_shard)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (processes = ranks x dp x tp)")
    ap.add_argument("--check", action="store_true", help="compare every step's gradients with one process on the global batch")
    ap.add_argument("--emulate", action="store_true",
                    help="stages sleep the schedule's profiled times instead of computing; messages and reductions real")
    args = ap.parse_args()
    for name in ("steps", "dp", "tp", "microbatch_size", "heads", "seq", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.emulate and (args.check or args.tp > 1 or args.shard):
        ap.error("--emulate runs whole, replicated stages that compute nothing: not with --check, --tp or --shard")

    stage_layers(zb.load_schedule(args.schedule), args.layers_per_stage)  # a cut that does not fit: before any process
    run_under_torchrun(lambda device: run(args, device))


def run(args, device: torch.device) -> None:
    sched = zb.load_schedule(args.schedule)
    m, S = sched.num_microbatches, sched.num_stages
    data = "dp_shard" if args.shard else "dp_replicate"
    mesh = mesh_for(sched.num_ranks, tp=args.tp, **{data: args.dp})
    rank, replica = mesh["pp"].get_local_rank(), mesh[data].get_local_rank()
    cut = stage_layers(sched, args.layers_per_stage)
    layers = args.layers or (sum(cut) if cut is not None else 2 * S)
    cfg = GPTConfig(layers=layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                    microbatch_size=args.microbatch_size, stages=S, cut=cut)
    cfg.check()
    whole = gpt_stages(cfg)
    stages = {s: st.to(device) for s, st in enumerate(whole) if sched.stage_to_rank[s] == rank}
    if args.emulate:
        emulate(args, sched, stages, mesh, data, device)
        return
    if args.tp > 1:  # each layer's heads and MLP columns split over the stage's tensor-parallel ranks
        stages = {s: parallelize_stage(st, mesh["tp"]) for s, st in stages.items()}
    if args.shard:  # each layer, then the stage, sharded over the data-parallel ranks
        stages = {s: shard_stage(st, mesh["dp_shard"]) for s, st in stages.items()}
    reference = gpt_stages(cfg) if args.check else None  # the same seed: the same weights
    runtime = PipelineRuntime(sched, stages, gpt_loss, device=device, timeout=args.timeout, mesh=mesh)
    optimizer = torch.optim.AdamW([p for st in stages.values() for p in st.parameters()], lr=args.lr)
    ref_opt = torch.optim.AdamW([p for st in reference for p in st.parameters()], lr=args.lr) if reference else None
    worst = 0.0
    for step in range(args.steps):
        inputs, targets = gpt_batch(cfg, m * args.dp, seed=step)  # a new global batch every step
        mine = slice(replica * m * cfg.microbatch_size, (replica + 1) * m * cfg.microbatch_size)
        optimizer.zero_grad()
        t0 = time.perf_counter()
        losses = runtime.step(inputs[mine] if 0 in stages else None, targets[mine] if S - 1 in stages else None)
        if reference is not None and ref_opt is not None:
            ref_opt.zero_grad()
            worst = max(worst, one_process(reference, stages, inputs, targets, m * args.dp))
            ref_opt.step()
        optimizer.step()
        if losses is not None and replica == 0 and mesh["tp"].get_local_rank() == 0:  # its share of the global batch
            print(f"step {step:3d}  loss {losses.mean().item():.4f}  {1e3 * (time.perf_counter() - t0):7.1f} ms", flush=True)
    if reference is not None:
        print(f"rank {dist.get_rank()}: max |grad - one process| = {worst:.3g} over stages {sorted(stages)}, "
              f"{args.steps} steps", flush=True)
    trace = runtime.trace()  # collective; every pipeline's rank 0 gets its own, the first replica's is written
    if trace is not None and args.trace is not None and replica == 0 and mesh["tp"].get_local_rank() == 0:
        save_trace(trace, args.trace)
        print(f"wrote {args.trace}", flush=True)
    runtime.close()


def emulate(args, sched, stages, mesh, data: str, device: torch.device) -> None:
    """``--emulate``: the steps with each stage sleeping its profiled passes (see the module)."""
    m, S = sched.num_microbatches, sched.num_stages
    stages = {  # each holding its real stage's gradient bytes, for the reductions
        s: emulated_stages(sched.profile, sched.stage_to_rank, bytes_per_unit=1.0, width=args.hidden,
                           grad_bytes=sum(p.numel() * p.element_size() for p in st.parameters()))[s].to(device)
        for s, st in stages.items()}
    step_s = sum(sched.profile.stages[s].t_opt or 0.0 for s in stages) / 1e3  # this rank's optimizer steps
    rows = m * args.microbatch_size  # one replica's share, activations of the real size
    inputs = torch.zeros(rows, args.seq, args.hidden, device=device)
    runtime = PipelineRuntime(sched, stages, emulated_loss, device=device, timeout=args.timeout, mesh=mesh)
    replica = mesh[data].get_local_rank()
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses = runtime.step(inputs if 0 in stages else None, inputs if S - 1 in stages else None)
        time.sleep(step_s)
        if losses is not None and replica == 0:
            print(f"step {step:3d}  loss {losses.mean().item():.4f}  {1e3 * (time.perf_counter() - t0):7.1f} ms",
                  flush=True)
    runtime.close()


def stage_layers(sched, text: str | None) -> tuple[int, ...] | None:
    """The transformer blocks of each stage: ``--layers-per-stage``, else a plan's cut, else None (even)."""
    planned = tuple(sched.partition.layers_per_stage) if sched.partition is not None else None
    if text is None:
        return planned
    try:
        given = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"error: --layers-per-stage {text!r}: give whole numbers, e.g. 3,3,2") from None
    if planned is not None and given != planned:
        raise SystemExit(f"error: --layers-per-stage {text} differs from the plan's cut {list(planned)}")
    return given


def one_process(whole, stages, inputs, targets, microbatches: int) -> float:
    """The whole model's gradients on the global batch in this process, microbatch by microbatch
    (one thread, as each rank runs); the largest difference from this rank's stages'."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        for st in whole:
            x = st(x)
        (gpt_loss(x, y) / microbatches).backward()
    torch.set_num_threads(threads)
    # a tensor-parallel or sharded gradient gathered whole, in the unparallelized model's order
    return max((full_tensor(st, n, p.grad).cpu() - q.grad).abs().max().item()
               for s, st in stages.items() for (n, p), q in zip(st.named_parameters(), whole[s].parameters()))


if __name__ == "__main__":
    main()
