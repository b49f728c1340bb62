"""Timing pipeline schedules on local ranks, shared by the runtime and real-pass benchmarks.

Each configuration is a (step, trace) pair; ``round_robin`` runs them one step each per round,
after warm-up rounds, so that load from elsewhere on the machine falls on all of them alike.
"""

from __future__ import annotations

import time

__all__ = ["ours", "round_robin", "launch"]


def ours(rank, sched, stages, inputs, targets, loss):
    from zbsearch.runtime import PipelineRuntime

    mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
    last = sched.num_stages - 1
    rt = PipelineRuntime(sched, mine, loss, timeout=120)

    def step():
        for st in mine.values():
            st.zero_grad(set_to_none=True)
        rt.step(inputs if 0 in mine else None, targets if last in mine else None)

    return step, rt.trace


def round_robin(runners: dict, iters: int, warmup: int) -> dict[str, tuple[list[float], list]]:
    """Wall time of each step (barrier to barrier), and the traces, after ``warmup`` rounds."""
    import torch.distributed as dist

    got: dict[str, tuple[list[float], list]] = {name: ([], []) for name in runners}
    for i in range(warmup + iters):
        for name, (step, trace) in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            wall = (time.perf_counter() - t0) * 1e3
            tr = trace() if trace is not None else None
            if i >= warmup:
                got[name][0].append(wall)
                got[name][1].append(tr)
    return got


def launch(fn, world: int, *args):
    """Rank 0's result of ``fn(rank, world, send, *args)`` on ``world`` local ranks."""
    from zbsearch.distributed import run_local

    return run_local(fn, world, *args, timeout=3600)[0]
