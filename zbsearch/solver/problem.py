"""What the solver optimises: a cost model, m microbatches, per-rank memory limits, an objective.

Schedules are per-rank action lists of F, B, W and fused BW passes (each microbatch's backward
on each stage one BW, or a B then a W), always judged by the core simulator, so every number the
solver reports is the number ``simulate`` gives.

Semantics and the relaxation every bound holds for. A schedule's value is that of its ASAP
timeline (each pass as early as its rank and inputs allow). Its *idle relaxation* lets passes
wait longer, so a rank may start late: the idle optimum is a lower bound on the ASAP optimum
over every order. In the idle model microbatches are interchangeable: take any timed
schedule and, on each stage in pipeline order, swap the labels of two microbatches whose F
passes run out of order on every later pass of theirs (and on their B and W passes). Every
time slot, dependency and memory count is kept, so the spans and peaks are too. Repeating
sorts F, then B (from the last stage down), then W: FIFO orders (each (stage, op) in
microbatch order) lose nothing *in the idle model*, and every bound of ``zbsearch.bounds`` and
the exact MILP's dual bound (which measures each rank's span from the start of its first pass,
a variable) bound the idle optimum, hence every ASAP schedule. With fused backwards the swaps
carry each backward's choice (fused or split) with its B and W, the split W passes of a stage
sort among themselves, and an F keeps its own price: the exact model prices forwards apart
from their microbatch's choice (``milp._ChoiceModel``), and the bounds at the cheaper of t_f
and t_ff (``CostModel.for_bounds``).

Under ASAP FIFO can lose for span (not for makespan): the relabelled schedule's first pass on a
rank may have its input earlier, so ASAP starts the rank earlier and its span grows. A
non-FIFO order (a rank starting with a later microbatch) can then be strictly better than every
FIFO one; the solver's schedules are judged by the simulator, never by the model.

Recomputation (``recompute``): "none", no recompute pass (the cost model offers none); "auto",
any microbatch on any stage may be checkpointed and recomputed by a pass the cost model offers;
"full", every microbatch on every stage is, by full recomputation (R), as Megatron's
``--recompute-granularity full`` does. The relabelling above does not carry over (a microbatch's
recomputation is decided at its F, on a stage before the ones the swap relabels), so no bound
of the solver relies on FIFO orders where recomputation is offered (``zbsearch.bounds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..actions import RECOMPUTES, Action, Op
from ..costs import CostModel
from ..formats.schedule import Objective
from ..limits import allowance, peaks_fit
from ..reductions import lane_floors
from ..simulator import Timeline, memory_trace, peak_memory, simulate

__all__ = ["Objective", "Problem", "Recomputation", "RECOMPUTATIONS"]

Recomputation = Literal["none", "auto", "full"]
RECOMPUTATIONS: tuple[str, ...] = ("none", "auto", "full")

@dataclass(frozen=True)
class Problem:
    """The costs (offering only the recomputation ``recompute`` allows: none for "none", full
    recomputation only for "full"), m, per-rank limits and the objective."""

    cost: CostModel
    num_microbatches: int
    limit: tuple[float, ...] | None = None  # per rank, in the profile's memory unit
    objective: Objective = "span"
    recompute: Recomputation = "none"

    @classmethod
    def make(cls, cost: CostModel, num_microbatches: int, limit: tuple[float, ...] | None = None,
             objective: Objective = "span", recompute: Recomputation = "none") -> Problem:
        """The problem with ``cost`` restricted to the recomputation ``recompute`` allows."""
        keep = {"none": (), "auto": RECOMPUTES, "full": (Op.R,)}[recompute]
        return cls(cost.without_recompute(keep), num_microbatches, limit, objective, recompute)

    @property
    def num_ranks(self) -> int:
        """Ranks of the cost model's placement."""
        return self.cost.num_ranks

    def limits(self) -> list[float]:
        """Per rank, the memory limit (infinite where none)."""
        return list(self.limit) if self.limit is not None else [float("inf")] * self.num_ranks

    def allowed(self) -> list[float]:
        """Per rank, the most memory the validator accepts under the limit."""
        return [allowance(x) for x in self.limits()]

    def value(self, tl: Timeline) -> float:
        """The objective of a simulated schedule (smaller is better): the longest per-rank span,
        the makespan, or the longest per-rank iteration (its span, then the reductions the
        passes do not hide and the optimizer steps: ``zbsearch.reductions``)."""
        if self.objective == "span":
            return max(tl.span)
        return tl.makespan if self.objective == "makespan" else tl.period

    @property
    def spans(self) -> bool:
        """Whether each rank's time counts from its own first pass (span and iteration), not
        from the first pass of all (makespan)."""
        return self.objective != "makespan"

    def lane_floors(self) -> list[float]:
        """Per rank, what its iteration adds to its span at least, for the iteration objective
        (0 for the others): ``reductions.lane_floors``. A bound on rank r's span plus its floor
        bounds the iteration."""
        if self.objective != "iteration":
            return [0.0] * self.num_ranks
        return lane_floors(self.cost)

    def lane_floor(self) -> float:
        """The least of ``lane_floors``: a bound on the longest span plus it bounds the iteration."""
        return min(self.lane_floors(), default=0.0)

    def evaluate(self, rows: list[list[Action]], pairs: list[list[int]] | None = None) -> tuple[float, Timeline]:
        """The objective's value of ``rows`` (with overlapped ``pairs``, ``Schedule.overlapped``)
        and their timeline, on the true costs."""
        tl = simulate(rows, self.cost, pairs)
        return self.value(tl), tl

    def fits(self, tl: Timeline) -> bool:
        """Whether every rank's memory stays within its limit."""
        return peaks_fit(tl.peak_memory, self.limit)

    def complete_recomputation(self, rows: list[list[Action]]) -> bool:
        """Whether ``rows`` recomputes as ``recompute`` requires: every microbatch on every
        stage for "full" (anything goes otherwise: the costs offer only what is allowed)."""
        if self.recompute != "full":
            return True
        return sum(a.op is Op.R for row in rows for a in row) == self.cost.num_stages * self.num_microbatches

    def fits_order(self, rows: list[list[Action]]) -> bool:
        """``fits`` before any simulation: memory depends on the order alone."""
        return self.limit is None or peaks_fit(peak_memory(memory_trace(rows, self.cost)), self.limit)
