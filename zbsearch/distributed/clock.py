"""One clock for timing device work, shared by the runtime's trace and the profiler.

On CPU it reads ``perf_counter``; on CUDA it records events on the current stream, so timing
never synchronises the device in the middle of the work it measures.
"""

from __future__ import annotations

import time

import torch

__all__ = ["DeviceClock"]


class DeviceClock:
    """Marks on the timeline the device's work runs on: ``perf_counter`` on CPU; on CUDA events
    on the current stream, readable once the stream has reached them (``sync``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        """A mark at this point of the device's work (an event on CUDA, a time on CPU)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (on CUDA, once both are reached: ``sync``)."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        """Wait until the device has reached every mark made so far (nothing to wait for on CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
