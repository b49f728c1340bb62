"""What the solver optimises: a cost model, m microbatches, per-rank memory limits, an objective.

Schedules are per-rank action lists of basic passes (F, B, W; never fused BW), always judged
by the core simulator, so every number the solver reports is the number ``simulate`` gives.

Symmetry: microbatches are interchangeable, so the solver only builds schedules that run the
F passes of a stage in microbatch order, and likewise the B and the W passes (FIFO). This
loses nothing: take any schedule and, on each stage in pipeline order, swap the labels of two
microbatches whose F passes run out of order on every later pass of theirs (and on their B
and W passes). The swapped schedule keeps every time slot, every dependency (a pass inherits
a slot that was later than the one its own predecessor now has) and every memory count, so
its spans and peaks are unchanged. Repeating sorts F, then B (from the last stage down), then
W. The solver's MILP bound is therefore a bound over all schedules.

With FIFO passes each rank starts with F(first stage of the rank, microbatch 0), which waits
only for microbatch 0's forwards on earlier ranks; its start time is a constant of the
profile, ``rank_start``. That lets the MILP measure spans from a constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..actions import Action, Op
from ..costs import CostModel
from ..dependencies import earliest_starts
from ..formats.schedule import Objective
from ..limits import allowance, fits
from ..simulator import Timeline, simulate

__all__ = ["Objective", "Problem"]



@dataclass(frozen=True)
class Problem:
    cost: CostModel
    num_microbatches: int
    limit: tuple[float, ...] | None = None  # per rank, in the profile's memory unit
    objective: Objective = "span"
    rank_start: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        c = self.cost
        first = earliest_starts(c, (0, Op.F))  # earliest start of F(s, 0)
        object.__setattr__(self, "rank_start", tuple(first[(min(c.rank_stages(r)), Op.F)] for r in range(c.num_ranks)))

    @property
    def num_ranks(self) -> int:
        return self.cost.num_ranks

    def limits(self) -> list[float]:
        return list(self.limit) if self.limit is not None else [float("inf")] * self.num_ranks

    def allowed(self) -> list[float]:
        """Per rank, the most memory the validator accepts under the limit."""
        return [allowance(x) for x in self.limits()]

    def value(self, tl: Timeline) -> float:
        """The objective of a simulated schedule (smaller is better)."""
        return max(tl.span) if self.objective == "span" else tl.makespan

    def evaluate(self, rows: list[list[Action]]) -> tuple[float, Timeline]:
        tl = simulate(rows, self.cost)
        return self.value(tl), tl

    def fits(self, tl: Timeline) -> bool:
        """Whether every rank's memory stays within its limit."""
        return all(fits(pk, x) for pk, x in zip(tl.peak_memory, self.limits()))
