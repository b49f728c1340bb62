"""The smallest memory limit any schedule can meet, and the one-line error below it."""

from __future__ import annotations

import math

from ..costs import CostModel
from ..errors import ZbError
from ..simulator import memory_trace, peak_memory
from ..tolerances import REL_TOL
from .heuristic import sequential_schedule
from .problem import Problem, Recomputation

__all__ = ["smallest_feasible_limit", "check_limit"]


def smallest_feasible_limit(cost: CostModel, num_microbatches: int, recompute: Recomputation = "none") -> list[float]:
    """Per rank, the least peak memory of any schedule: that of the sequential schedule.

    Exact for balanced profiles (what F allocates, B and W free): right after the last F of a
    rank's stages for some microbatch, that microbatch holds the activations of all of them
    (its B passes need every F first) and no microbatch holds a negative amount, so every
    schedule reaches the sum of m_f over the rank's stages; the sequential schedule reaches
    exactly that and never more. With recomputation ("auto", "full"), the sequential schedule
    that checkpoints every forward but the last on each rank (``sequential_schedule``): the
    rank's last stage's backward needs its full activations, and every other stage of the
    rank holds at least what a checkpointed forward keeps; otherwise (one stage per rank)
    every B needs its stage's full activations, so the least peak is that (m_f), as without."""
    problem = Problem.make(cost, num_microbatches, recompute=recompute)
    rows = sequential_schedule(problem)
    return peak_memory(memory_trace(rows, problem.cost))  # what simulate would give, without the timing


def _round_up(x: float, digits: int = 4) -> float:
    """x rounded up to ``digits`` significant digits, so a stated limit is never too small."""
    if x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale * (1 - REL_TOL)) / scale


def check_limit(cost: CostModel, num_microbatches: int, limit: list[float] | None, spec: str | None, unit: str,
                recompute: Recomputation = "none") -> None:
    """Raise a one-line ZbError naming the smallest feasible limit if ``limit`` is below it."""
    if limit is None:
        return
    need = smallest_feasible_limit(cost, num_microbatches, recompute)
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
    why = "one microbatch's activations" if recompute == "none" else "one microbatch's activations, recomputed"
    hint = ""
    if recompute == "none" and cost.can_recompute and _lower_with_recompute(cost, num_microbatches):
        hint = "; with --recompute auto it is lower"
    raise ZbError(
        f"memory limit {spec or limit[r]:} is infeasible: rank {r} needs at least {need[r]:.6g} {unit} "
        f"({why}); the smallest feasible limit for this profile is {least}{hint}"
    )


def _lower_with_recompute(cost: CostModel, num_microbatches: int) -> bool:
    """Whether recomputation lowers the smallest feasible limit on some rank."""
    base = smallest_feasible_limit(cost, num_microbatches)
    return any(a < b * (1 - REL_TOL) for a, b in zip(smallest_feasible_limit(cost, num_microbatches, "auto"), base))
