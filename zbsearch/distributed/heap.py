"""Keep freed host memory in the process, so that passes reuse pages instead of faulting them in.

glibc gives large blocks back to the kernel as they are freed (blocks above its mmap threshold
are unmapped, a free top of the heap is trimmed), and the next pass that allocates as much
faults every page in again, zeroed by the kernel: on CPU a visible share of a pass (figures in
the profiler's bench report). How much a pipeline rank faults depends on the schedule around
its passes, so without this a pass costs what the memory churn around it makes it cost, not
what the profile measured, and the profiler (one microbatch at a time) churns differently
from every schedule.

The price: the process keeps its high-water mark of host memory, as CUDA's caching allocator
does on the device. The profiler and the runtime apply it by default (``keep_heap=False`` in
either leaves the allocator as it is; give both the same, or the profile times another
allocator than the one the runtime runs on).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_heap"]

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap and stay there once freed; above it glibc may
# refuse (its cap depends on the version), and then its largest accepted value is used.
_THRESHOLDS = (1 << 30, 32 << 20)


@functools.cache
def keep_heap() -> bool:
    """From now on this process keeps what it frees (glibc only; idempotent). True when applied,
    False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # mallopt's parameters are glibc's
        return False
    if not mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)):
        return False
    return any(mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(t)) for t in _THRESHOLDS)
