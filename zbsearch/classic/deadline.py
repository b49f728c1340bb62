"""When a classic builder that improves its schedule step by step stops: one rule for all of them.

A builder given a ``deadline`` (a ``time.monotonic()`` instant) always completes one schedule;
once the deadline has passed it stops improving and returns the best complete schedule it has
(ZB-V: the best of its constructions so far; V-Half and V-Min: the building blocks squeezed as
far as they got). ``now`` is the clock they all read, and the solver's budget and construction
with them, so that a test can replace it.
"""

from __future__ import annotations

import time

__all__ = ["now", "passed"]


def now() -> float:
    """The clock every builder and the solver's budget read (monotonic seconds)."""
    return time.monotonic()


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (None: none) has passed."""
    return deadline is not None and now() > deadline
