"""The start and end of a training script under torchrun, shared by the examples.

Each process joins the default group (NCCL with one GPU per local rank when CUDA is there,
else gloo with one CPU thread per rank, since the ranks share the machine's cores), runs the
script's work, and leaves: the private groups still open are closed, then the default group
is destroyed. A user error (ZbError, PipelineError) or a failure of the process group itself
(its store gone, a peer dead: torch's ``DistError``) is one line naming the rank; the process
then exits at once, without the collective teardown a dead peer would block.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import ZbError
from ..runtime.errors import first_line
from ..runtime.groups import close_all

__all__ = ["run_under_torchrun"]


def run_under_torchrun(work: Callable[[torch.device], None]) -> None:
    """Run ``work(device)`` on this torchrun process, then tear the process group down."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    try:
        work(torch.device("cuda") if cuda else torch.device("cpu"))
    except ZbError as err:
        print(f"rank {rank}: error: {str(err).removeprefix(f'rank {rank}: ')}", file=sys.stderr, flush=True)
        os._exit(1)  # a peer may be gone: skip the collective teardown
    except dist.DistError as err:
        print(f"rank {rank}: error: the process group failed (a peer or the store gone?): {first_line(err)}",
              file=sys.stderr, flush=True)
        os._exit(1)
    close_all()
    dist.destroy_process_group()
