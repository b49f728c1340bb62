"""Attach a schedule's predicted timeline summary (the ``predicted`` block of the file)."""

from __future__ import annotations

from .bounds import makespan_lower_bound, span_lower_bound
from .costs import CostModel
from .formats.schedule import Predicted, Schedule
from .simulator import Timeline, simulate

__all__ = ["cost_model", "timeline", "predict", "with_prediction"]


def cost_model(schedule: Schedule) -> CostModel:
    """The cost model of the schedule's own profile and placement."""
    return CostModel.from_profile(schedule.profile, schedule.stage_to_rank)


def timeline(schedule: Schedule) -> Timeline:
    """The schedule's timeline on its own profile: when every action runs, what memory each rank holds.

    Raises:
        ZbError: the order cannot run (a deadlock, or a pass no rank runs); ``zbsearch.validate``
            says why.
    """
    return simulate(schedule.rank_actions, cost_model(schedule), schedule.overlapped)


def predict(schedule: Schedule, tl: Timeline | None = None) -> Predicted:
    """The summary of ``tl``, the schedule's timeline on its profile (simulated here if not given)."""
    cost = cost_model(schedule)
    tl = tl if tl is not None else simulate(schedule.rank_actions, cost, schedule.overlapped)
    m = schedule.num_microbatches
    return Predicted(
        makespan=tl.makespan,
        span=tl.span,
        bubble_rate=tl.bubble_rate,
        peak_memory=tl.peak_memory,
        lower_bound=span_lower_bound(cost, m),
        lower_bound_makespan=makespan_lower_bound(cost, m),
        bubble_rate_makespan=tl.bubble_rate_makespan(),
        iteration=tl.iteration if tl.finish else None,
    )


def with_prediction(schedule: Schedule, tl: Timeline | None = None) -> Schedule:
    """``schedule`` with its ``predicted`` block set from ``tl`` (simulated here if not given);
    the same object, returned for chaining."""
    schedule.predicted = predict(schedule, tl)
    return schedule
