"""zbsearch's solver and bounds judged against the exact oracle, one instance at a time.

Shared by ``tests/solver/test_oracle.py`` (a modest sample, every CI run) and
``bench/solver_gap.py`` (the larger sweep): both ask the same questions of the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zbsearch import bounds
from zbsearch.solver import solve
from zbsearch.validator import find_problem

from .oracle import Instance

__all__ = ["Verdict", "TOL", "judge", "component_bounds"]

TOL = 1e-6  # relative: float sums of pass times vs the oracle's exact optimum


@dataclass
class Verdict:
    """What zbsearch says about one instance and objective, next to the true optimum."""

    value: float  # zbsearch's schedule, simulated
    status: str
    lower_bound: float  # SolverInfo.lower_bound
    predicted_bound: float  # Predicted.lower_bound (span) / lower_bound_makespan: memory-blind
    problem: str | None  # the validator's complaint about zbsearch's schedule (None: valid)
    optimum: float
    time_s: float
    components: dict[str, float] = field(default_factory=dict)
    classic: dict[str, float] = field(default_factory=dict)  # SolverInfo.classic: the classic kinds within the limit
    fused: int = 0  # backwards the schedule runs fused (BW)
    split: int = 0  # ... and split (B, then W)

    @property
    def gap(self) -> float:
        return self.value / self.optimum - 1

    def unsound(self) -> dict[str, float]:
        """Every bound zbsearch computes that exceeds the true optimum (name -> bound)."""
        named = {"solver lower_bound": self.lower_bound, "predicted lower_bound": self.predicted_bound,
                 **self.components}
        return {k: v for k, v in named.items() if v > self.optimum * (1 + TOL)}

    @property
    def false_optimal(self) -> bool:
        return self.status == "optimal" and self.value > self.optimum * (1 + TOL)

    @property
    def below_optimum(self) -> bool:
        return self.value < self.optimum * (1 - TOL)


def component_bounds(inst: Instance, objective: str) -> dict[str, float]:
    """Each bound of ``zbsearch.bounds`` on its own (max over ranks for per-rank ones)."""
    cost, m, lim = inst.cost, inst.m, inst.limit
    if objective == "makespan":
        return {"makespan_lower_bound": bounds.makespan_lower_bound(cost, m),
                "memory_makespan_lower_bound": bounds.memory_makespan_lower_bound(cost, m, lim)}
    out = {"rank_span_lower_bounds": max(bounds.rank_span_lower_bounds(cost, m)),
           "rank_chain_span_lower_bounds": max(bounds.rank_chain_span_lower_bounds(cost, m, lim))}
    if lim is not None:
        out["rank_memory_span_lower_bounds"] = max(bounds.rank_memory_span_lower_bounds(cost, m, lim))
    return out


def judge(inst: Instance, objective: str, optimum: float, time_limit: float, recompute: str = "none") -> Verdict:
    """Run ``zbsearch.solver.solve`` on the instance (recomputing as ``recompute`` allows) and
    collect its claims."""
    t0 = time.monotonic()
    res = solve(inst.profile, inst.m, inst.limit, chunks=inst.chunks, time_limit=time_limit, objective=objective,
                recompute=recompute)  # type: ignore[arg-type]
    elapsed = time.monotonic() - t0
    pred = res.schedule.predicted
    predicted = pred.lower_bound if objective == "span" else pred.lower_bound_makespan
    return Verdict(
        value=res.info.value, status=res.info.status, lower_bound=res.info.lower_bound,
        predicted_bound=predicted, problem=find_problem(res.schedule, memory_limit=inst.limit),
        optimum=optimum, time_s=elapsed, components=component_bounds(inst, objective),
        classic=res.info.classic, fused=res.info.fused_backwards, split=res.info.split_backwards,
    )
