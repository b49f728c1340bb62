"""torch.distributed plumbing shared by the runtime, the profiler, the demo and the examples.

``run_local`` starts p local processes in one gloo (or NCCL) group and gathers what they
return; ``run_under_torchrun`` starts and ends a torchrun script; ``DeviceClock`` times device
work without synchronising mid-step; ``timeouts`` holds how long a process waits for
another (``PEER_TIMEOUT_S``: a rank for another rank's message).
"""

from .clock import DeviceClock
from .local import run_local
from .timeouts import PEER_TIMEOUT_S
from .torchrun import run_under_torchrun

__all__ = ["DeviceClock", "run_local", "run_under_torchrun", "PEER_TIMEOUT_S"]
