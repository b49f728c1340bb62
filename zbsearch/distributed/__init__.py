"""torch.distributed plumbing shared by the runtime, the profiler and the demo.

``run_local`` starts p local processes in one gloo (or NCCL) group and gathers what they
return; ``DeviceClock`` times device work without synchronising mid-step.
"""

from .clock import DeviceClock
from .local import run_local

__all__ = ["DeviceClock", "run_local"]
