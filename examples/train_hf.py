"""Train a Hugging Face causal LM with a zbsearch schedule, one process per rank.

    zbsearch profile --hf gpt2-tiny --stages 4 --placement v -o gpt2-v.json   # or a config JSON
    zbsearch solve -p gpt2-v.json -m 8 --chunks 2 -o plan.json                # 2 pieces per rank
    torchrun --nproc-per-node 2 examples/train_hf.py plan.json --hf gpt2-tiny --steps 20 --check

or with the cut planned too:

    zbsearch profile --hf gpt2-tiny --per-layer -o gpt2-layers.json
    zbsearch plan -l gpt2-layers.json -r 2 -m 8 --memory 1GiB -o plan.json
    torchrun --nproc-per-node 2 examples/train_hf.py plan.json --steps 20 --check
    torchrun --nproc-per-node 4 examples/train_hf.py plan.json --dp 2 --check   # two replicas

Every rank builds the same randomly initialised model from one seed (``--hf``: a preset such
as gpt2-tiny / llama-tiny, ``tiny:MODEL_TYPE`` or a config JSON; to train real weights, load
them instead in ``build``), cuts it into the schedule's stages (``zbsearch.models.hf``) and
keeps its own. ``--hf``, ``--seq``, ``-b`` and ``--layers-per-stage`` default to what the
plan's profile measured (a plan from ``zbsearch plan`` gives its cut); the runtime refuses a
model or shapes other than those. A tied
embedding/LM head is summed across ranks by the runtime and counted once by the optimizer,
which clips by the global gradient norm with post-validation (no barrier before the step).
``--dp N``: N replicas of the pipeline, each on its share of the global batch, the runtime
reducing the gradients across them.
``--check``: before training, every rank compares its gradients of one step with the
unsplit model's on the global batch in one process and prints the largest difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zbsearch as zb
from zbsearch.distributed.mesh import mesh_for
from zbsearch.distributed.torchrun import run_under_torchrun
from zbsearch.errors import ZbError
from zbsearch.models.hf import (
    DEFAULTS,
    check_length,
    hf_batch,
    hf_config,
    hf_loss,
    hf_model,
    hf_stages,
    parse_counts,
    parse_names,
)
from zbsearch.runtime import PipelineRuntime, PostValidatedOptimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", type=Path, help="schedule JSON (its number of ranks = processes)")
    ap.add_argument("--hf", default=None, help="preset (gpt2-tiny, llama-tiny, qwen2-tiny, mistral-tiny), tiny:MODEL_TYPE or "
                    "config JSON (default: the plan's profile's, else gpt2-tiny)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--microbatch-size", "-b", type=int, default=None, help="sequences per microbatch (default: the profile's)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the profile's)")
    ap.add_argument("--layers-per-stage", default=None, help="decoder layers of each stage, e.g. 3,3,2 (default: the profile's)")
    ap.add_argument("--selective", default=None,
                    help="which modules of each layer RS passes recompute: attention (the attention core) or mlp "
                         "(default: the profile's mode)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    ap.add_argument("--check", action="store_true", help="compare one step's gradients with the unsplit model first")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (processes = ranks x dp)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for another rank before failing")
    args = ap.parse_args()
    try:
        settle(args)
    except ZbError as err:
        sys.exit(f"error: {err}")
    run_under_torchrun(lambda device: run(args, device))


def settle(args) -> None:
    """Fill the model options from the plan's profile (what it measured), then check them."""
    if not args.schedule.is_file():
        raise ZbError(f"{args.schedule}: no such schedule file")
    sched = zb.load_schedule(args.schedule)
    profile = sched.profile
    if sched.partition is not None:  # a plan: its cut of the layers, piece by piece for a V
        planned = sched.partition.layers_per_stage
        given = parse_counts(args.layers_per_stage)
        if given is not None and given != planned:
            raise ZbError(f"--layers-per-stage {args.layers_per_stage} differs from the plan's cut {planned}")
        args.layers_per_stage = planned
    measured = dict(profile.model or {})
    source = str(measured.get("model", ""))
    if source == "zbsearch.models.hf:build":  # profiled with --model ...hf:build --model-arg k=v
        measured.update(config=DEFAULTS["config"], **measured.get("args", {}))
    elif source.startswith("hf "):  # profiled with --hf CONFIG
        measured["config"] = source.removeprefix("hf ")
    fallback = {"hf": DEFAULTS["config"], "seq": DEFAULTS["seq"],
                "microbatch_size": profile.microbatch_size or DEFAULTS["microbatch_size"], "layers_per_stage": None,
                "selective": profile.selective}
    for key, default in fallback.items():
        if getattr(args, key) is None:
            setattr(args, key, measured.get("config" if key == "hf" else key, default))
    for name in ("steps", "microbatch_size", "seq", "dp"):
        if getattr(args, name) < 1:
            raise ZbError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    check_length(hf_config(args.hf), args.seq)
    args.layers_per_stage = parse_counts(args.layers_per_stage)
    args.selective = parse_names(args.selective)


def build(args, num_stages: int):
    config = hf_config(args.hf)
    return config, hf_stages(hf_model(config, seed=0).train(), num_stages, args.layers_per_stage, args.selective)


def run(args, device: torch.device) -> None:
    sched = zb.load_schedule(args.schedule)
    m, S = sched.num_microbatches, sched.num_stages
    mesh = mesh_for(sched.num_ranks, dp_replicate=args.dp)
    rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    config, cut = build(args, S)
    stages = {s: st.to(device) for s, st in enumerate(cut.stages) if sched.stage_to_rank[s] == rank}
    runtime = PipelineRuntime(sched, stages, hf_loss, device=device, timeout=args.timeout, tied=cut.tied, mesh=mesh)
    share = m * args.microbatch_size

    def batch(step: int):  # the global batch: every replica's share
        return hf_batch(config, args.dp * share, args.seq, seed=1000 + step)

    def mine(batch):
        (ids, mask), labels = batch
        part = slice(replica * share, (replica + 1) * share)
        return (ids[part], mask[part]), labels[part]

    if args.check:
        check(args, runtime, stages, batch(0), m * args.dp, mine)
    params = list({id(p): p for s in sorted(stages) for p in stages[s].parameters()}.values())
    opt = PostValidatedOptimizer(torch.optim.AdamW(params, lr=args.lr), args.max_norm, stages=stages, tied=cut.tied,
                                 timeout=args.timeout, group=runtime.group)
    opt.attach(runtime)
    for step in range(args.steps):
        inputs, labels = mine(batch(step))
        opt.validate()
        t0 = time.perf_counter()
        losses = runtime.step(inputs if 0 in stages else None, labels if S - 1 in stages else None)
        if losses is not None and replica == 0:  # its share of the global batch
            print(f"step {step:3d}  loss {losses.mean().item():.4f}  {1e3 * (time.perf_counter() - t0):7.1f} ms", flush=True)
    verdict = opt.validate()
    if dist.get_rank() == 0:
        print(
            f"last step: global grad norm {verdict.total_norm:.4f}, clipped {verdict.clipped}; steps by kind {dict(opt.counts)}"
        )
    opt.close()
    runtime.close()


def check(args, runtime, stages, batch, m: int, mine) -> None:
    """One step's gradients on this rank against the unsplit model's on the global batch (``m``
    microbatches) in this process; ``mine`` takes this replica's share."""
    (ids, mask), labels = batch
    inputs, targets = mine(batch)
    runtime.step(inputs if 0 in stages else None, targets if runtime.last in stages else None)
    _, whole = build(args, runtime.schedule.num_stages)
    for i, am, y in zip(ids.chunk(m), mask.chunk(m), labels.chunk(m)):
        x = (i, am)
        for st in whole.stages:
            x = st(*x)
            x = x if isinstance(x, tuple) else (x,)
        (hf_loss(x[0], y) / m).backward()
    worst = 0.0
    for s, st in stages.items():
        ref = dict(whole.stages[s].named_parameters(remove_duplicate=False))
        for name, p in st.named_parameters(remove_duplicate=False):
            worst = max(worst, (p.grad.cpu() - ref[name].grad).abs().max().item())
    for st in stages.values():
        st.zero_grad(set_to_none=True)
    print(f"rank {dist.get_rank()}: max |grad - one process| = {worst:.3g} over stages {sorted(stages)}", flush=True)


if __name__ == "__main__":
    main()
