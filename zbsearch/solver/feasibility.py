"""The smallest memory limit any schedule can meet, and the one-line error below it."""

from __future__ import annotations

import math

from ..costs import CostModel
from ..errors import ZbError
from ..simulator import memory_trace, peak_memory
from ..tolerances import REL_TOL
from .heuristic import sequential_schedule
from .problem import Problem

__all__ = ["smallest_feasible_limit", "check_limit"]


def smallest_feasible_limit(cost: CostModel, num_microbatches: int) -> list[float]:
    """Per rank, the least peak memory of any schedule: that of the sequential schedule.

    Exact for balanced profiles (what F allocates, B and W free): right after the last F of a
    rank's stages for some microbatch, that microbatch holds the activations of all of them
    (its B passes need every F first) and no microbatch holds a negative amount, so every
    schedule reaches the sum of m_f over the rank's stages; the sequential schedule reaches
    exactly that and never more."""
    rows = sequential_schedule(Problem(cost, num_microbatches))
    return peak_memory(memory_trace(rows, cost))  # what simulate would give, without the timing


def _round_up(x: float, digits: int = 4) -> float:
    """x rounded up to ``digits`` significant digits, so a stated limit is never too small."""
    if x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale * (1 - REL_TOL)) / scale


def check_limit(cost: CostModel, num_microbatches: int, limit: list[float] | None, spec: str | None, unit: str) -> None:
    """Raise a one-line ZbError naming the smallest feasible limit if ``limit`` is below it."""
    if limit is None:
        return
    need = smallest_feasible_limit(cost, num_microbatches)
    allowed = Problem(cost, num_microbatches, tuple(limit)).allowed()
    short = [r for r, (have, n) in enumerate(zip(allowed, need)) if have < n]
    if not short:
        return
    p = cost.num_ranks
    text = (spec or "").strip().lower()
    if text.endswith("p"):
        least = f"{_round_up(max(n / (p * cost.activation_unit(r)) for r, n in enumerate(need))):g}p"
    elif unit == "bytes":
        least = f"{_round_up(max(need) / 2**30):g} GiB ({math.ceil(max(need))} bytes)"
    else:
        least = f"{_round_up(max(need)):g} {unit} per rank"
    r = short[0]
    raise ZbError(
        f"memory limit {spec or limit[r]:} is infeasible: rank {r} needs at least {need[r]:.6g} {unit} "
        f"(one microbatch's activations); the smallest feasible limit for this profile is {least}"
    )
