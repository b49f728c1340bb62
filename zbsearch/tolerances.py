"""Float tolerances: how far two computed numbers may differ and still count as equal.

Times and memory are sums of per-pass costs. The simulator, the schedule builders, the solver
and the bounds add the same costs in different orders, so results that are equal in exact
arithmetic differ by rounding. Each meaning of "equal up to rounding" has one constant here.
"""

from __future__ import annotations

__all__ = ["EPS_MS", "REL_TOL", "ABS_TOL", "NEGLIGIBLE_SHARE", "negligible"]

EPS_MS = 1e-9
"""Times (ms) closer than this are the same instant.

Far below anything the profiler can time (``MIN_TIME_MS``), far above the rounding error of a
sum of pass times."""

REL_TOL = 1e-9
"""Values within this share of each other are equal: memory against a limit, the activation
units of two profiles, a ratio that should be a whole number."""

ABS_TOL = 1e-12
"""Added to ``REL_TOL``'s share for values near zero, such as a limit of 0 on a rank that keeps
no activations."""

NEGLIGIBLE_SHARE = 0.01
"""A pass under this share of its stage's F + B + W has (almost) nothing to do, such as a
first stage's B (no input gradient to compute): its time is a few microseconds of call
overhead and timer resolution, so its spread, its drift between rounds and its error against
a runtime trace say nothing about the machine or the profile, and it cannot move a schedule."""


def negligible(pass_ms: float, stage_ms: float) -> bool:
    """Whether a pass of ``pass_ms`` is negligible in a stage whose F + B + W take ``stage_ms``
    (``NEGLIGIBLE_SHARE``): not to be warned about or compared."""
    return pass_ms < NEGLIGIBLE_SHARE * stage_ms
