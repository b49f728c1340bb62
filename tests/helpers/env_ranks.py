"""Two ranks launched as env:// launchers (srun, mpirun) launch them: rank 0 hosts the store.

``python -m tests.helpers.env_ranks SCENARIO`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set runs one rank of a scenario through ``run_under_torchrun``:

* ``tied``: a runtime whose tied weight spans both ranks and a post-validated optimizer, two
  steps, then a clean exit (both must exit 0);
* ``die-in-step``: rank 0 dies inside its optimizer step of the second iteration, while rank 1
  is still computing; rank 1 then reaches the store rank 0 held;
* ``die-before-group``: rank 0 dies before creating the optimizer's private group, which rank
  1 is setting up.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import zbsearch as zb
from zbsearch.distributed.torchrun import run_under_torchrun
from zbsearch.runtime import PipelineRuntime, PostValidatedOptimizer


class Stage(nn.Module):
    def __init__(self, shared: nn.Linear, last: bool) -> None:
        super().__init__()
        self.shared, self.own, self.last = shared, nn.Linear(8, 8), last

    def forward(self, x):
        return self.own(torch.tanh(self.shared(x))) if not self.last else self.shared(torch.tanh(self.own(x)))


def work(scenario: str) -> None:
    rank = dist.get_rank()
    profile = zb.Profile(name="unit", memory_unit="activations",
                         stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * 2)
    sched = zb.build_classic("zb-h1", profile, 4)
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    stage = Stage(shared, rank == 1)
    tied = [("0.shared.weight", "1.shared.weight"), ("0.shared.bias", "1.shared.bias")]
    loss = (lambda out, y: ((out - y) ** 2).mean()) if rank == 1 else None
    runtime = PipelineRuntime(sched, {rank: stage}, loss, tied=tied, timeout=20)
    step = [0]
    if rank == 1:  # rank 1 finishes its step late, after rank 0's optimizer step
        runtime.on_stage_done(lambda s: time.sleep(2.0) if step[0] == 1 and scenario == "die-in-step" else None)
    if rank == 0 and scenario == "die-before-group":
        os._exit(3)
    opt = PostValidatedOptimizer(torch.optim.SGD(stage.parameters(), lr=0.1), 1.0, stages={rank: stage}, tied=tied,
                                 timeout=20)
    if rank == 0 and scenario == "die-in-step":
        stepper = opt.step

        def dying_step():
            if step[0] == 1:
                os._exit(3)
            stepper()

        opt.step = dying_step  # type: ignore[method-assign]
    opt.attach(runtime)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for i in range(2):
        step[0] = i
        opt.validate()
        runtime.step(x if rank == 0 else None, y if rank == 1 else None)
    opt.validate()
    if scenario == "tied":
        runtime.close()
        opt.close()


if __name__ == "__main__":
    run_under_torchrun(lambda device: work(sys.argv[1]))
