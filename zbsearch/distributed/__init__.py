"""torch.distributed plumbing shared by the runtime, the profiler, the demo and the examples.

``run_local`` starts p local processes in one gloo (or NCCL) group and gathers what they
return; ``run_under_torchrun`` starts and ends a torchrun script; ``DeviceClock`` times device
work without synchronising mid-step; ``timeouts`` holds how long a process waits for
another (``PEER_TIMEOUT_S``: a rank for another rank's message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _lazy
from .timeouts import PEER_TIMEOUT_S

if TYPE_CHECKING:
    from .clock import DeviceClock
    from .local import run_local
    from .torchrun import run_under_torchrun

__all__ = ["DeviceClock", "run_local", "run_under_torchrun", "PEER_TIMEOUT_S"]

# names that need torch load on first use, so the timeouts can be read without it
_WHERE = {"DeviceClock": ".clock", "run_local": ".local", "run_under_torchrun": ".torchrun"}


def __getattr__(name: str) -> Any:
    return _lazy.load(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted(__all__)
