"""Bubble rate against memory limit: the sweep (file format in ``formats.frontier``, plot in ``render``).

The sweep runs from the smallest feasible limit (with recomputation, where it is allowed: for the
V placement that is below one microbatch's activations per rank) up to the peak memory of the
best schedule found without a limit (about 2p for the paper's profiles): past that peak a larger
limit cannot change anything, and the sweep stops earlier once a point's bubble is as low as the
unlimited one. Recomputation counts as bubble (``zbsearch.simulator``).

``time_limit`` is the total for the sweep: the unlimited solve gets a quarter, then each point
the time left divided by the points left, less what a solve has needed beyond its own limit
so far (checking, validating and predicting the schedule it returns, which no limit cuts);
once too little is left for another point the sweep stops with the points so far (at least
one). Each point starts from the previous point's schedule (within a smaller limit, so within
this one too), so the curve never rises, and the unlimited value is the best of all. With
``recompute`` "auto" each point's solve also builds the schedules without recomputation and
with full recomputation at its limit (``solve``): the curve is never above their constructions.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ..costs import CostModel
from ..errors import ZbError
from ..formats.frontier import Frontier, FrontierPoint
from ..formats.profile import Profile
from ..limits import peaks_fit
from ..simulator import bubble_rate
from ..tolerances import REL_TOL
from .feasibility import smallest_feasible_limit
from .problem import Objective, Recomputation
from .solve import Progress, solve, solver_placement

__all__ = ["frontier"]


def _grid(lo: float, hi: float, step: float = 0.25) -> list[float]:
    xs = [lo] + [k * step for k in range(math.floor(lo / step) + 1, math.ceil(hi / step) + 1) if lo < k * step < hi]
    return xs + ([hi] if hi > lo else [])


def _scale(memory: list[float], units: list[float], verb: str) -> float:
    """The smallest x with memory <= x * unit on every rank. A rank that keeps no activations
    (unit 0, e.g. a parameter-free first stage) gets a limit of 0 at every x, which fits
    only if it never holds memory."""
    for r, (mem, unit) in enumerate(zip(memory, units)):
        if unit <= 0 and mem > 0:
            raise ZbError(f"rank {r} keeps no activations after its forwards (M_B = 0) but {verb} {mem:g} "
                          f"of memory at some point, so no limit of the form x * p * M_B fits it")
    ratios = [mem / unit for mem, unit in zip(memory, units) if unit > 0]
    if not ratios:
        raise ZbError("no rank keeps activations (M_B = 0 everywhere): memory does not limit the schedule")
    return max(ratios)


def frontier(
    profile: Profile,
    num_microbatches: int,
    *,
    chunks: int = 1,
    objective: Objective = "span",
    time_limit: float = 2.0,
    milp: bool = False,
    uniform_costs: bool = False,
    recompute: Recomputation = "none",
    progress: Progress | None = None,
) -> Frontier:
    """Solve at each limit of the sweep within ``time_limit`` seconds in all; ``progress`` hears
    each solve's progress, its phase prefixed with the limit being solved. ``recompute``: as for
    ``solve``; the sweep then starts from the least memory any schedule needs with it."""
    deadline = time.monotonic() + time_limit
    m = num_microbatches
    cost = CostModel.from_profile(profile, solver_placement(profile.num_ranks, chunks))
    cost.check_microbatches(m)
    p = cost.num_ranks
    units = [p * cost.activation_unit(r) for r in range(p)]
    need = smallest_feasible_limit(cost, m, recompute)
    lo = _scale(need, units, "needs")
    kw: dict[str, Any] = dict(chunks=chunks, objective=objective, milp=milp, uniform_costs=uniform_costs,
                              recompute=recompute)
    over = 0.0  # the most a solve has taken beyond its own time limit

    def timed_solve(limit: list[float] | None, share: float, what: str, **more):
        nonlocal over
        t = time.monotonic()
        said = None if progress is None else (lambda phase, v, b: progress(f"{what}: {phase}", v, b))
        res = solve(profile, m, limit, time_limit=share, progress=said, **kw, **more)
        over = max(over, time.monotonic() - t - share)
        return res

    free = timed_solve(None, time_limit / 4, "no limit")
    hi = _scale(free.timeline.peak_memory, units, "holds")
    place = list(cost.stage_to_rank)
    unlimited = bubble_rate(free.info.value, max(free.timeline.busy))
    points: list[FrontierPoint] = []
    best, best_value = None, float("inf")  # a schedule within a smaller limit is within this one too: the curve never rises
    grid = _grid(lo, max(lo, hi))
    for i, x in enumerate(grid):
        left = deadline - time.monotonic()
        if points and left <= over:
            break
        share = max(0.0, left / (len(grid) - i) - over)
        limit = [x * u for u in units]
        start = best
        # where the unlimited solve's schedule fits, it is a start too: the curve ends where it does
        if (free.schedule.stage_to_rank == place and free.info.value < best_value
                and peaks_fit(free.timeline.peak_memory, limit)):
            start = free.schedule.rank_actions
        res = timed_solve(limit, share, f"{x:.4g}p ({i + 1}/{len(grid)})", start=start)
        if res.schedule.stage_to_rank == place:  # (not a classic schedule on another placement)
            best, best_value = res.schedule.rank_actions, res.info.value
        pred, busy = res.schedule.predicted, max(res.timeline.busy)
        assert pred is not None  # solve always attaches the prediction
        pt = FrontierPoint(
            limit=x, bubble_rate=bubble_rate(res.info.value, busy),
            bound_bubble_rate=max(0.0, bubble_rate(res.info.lower_bound, busy)),
            span=max(pred.span), makespan=pred.makespan,
            peak_memory=pred.peak_memory, lower_bound=res.info.lower_bound, gap=res.info.gap, status=res.info.status,
            recomputed=res.info.recomputed,
        )
        points.append(pt)
        if pt.bubble_rate <= unlimited + REL_TOL:
            break
    unlimited = min([unlimited] + [pt.bubble_rate for pt in points])  # the unlimited solve may have found worse
    return Frontier(
        profile=profile.name, num_microbatches=m, chunks=chunks, objective=objective, uniform_costs=uniform_costs,
        recompute=recompute, unlimited_bubble_rate=unlimited, points=points,
    )
