"""Automatic schedule solver: least bubble under a memory limit, with a certified gap.

``solve`` builds schedules with memory-aware list-scheduling heuristics on the true per-stage
costs, improves them with MILP windows (PuLP + HiGHS), and reports a provable lower bound.
``frontier`` sweeps the memory limit. See each module for the method and its proofs.
"""

from .feasibility import check_limit, smallest_feasible_limit
from .frontier import frontier
from .problem import RECOMPUTATIONS, Objective, Problem, Recomputation
from .solve import Progress, SolveResult, SolverInfo, progress_text, solve, solver_placement, uniform_profile
from .verdict import bound_name, covered, explain, gap_text, status_text, unsearched

__all__ = [
    "solve",
    "SolveResult",
    "SolverInfo",
    "Problem",
    "Objective",
    "Recomputation",
    "RECOMPUTATIONS",
    "smallest_feasible_limit",
    "check_limit",
    "solver_placement",
    "uniform_profile",
    "frontier",
    "Progress",
    "progress_text",
    "status_text",
    "gap_text",
    "explain",
    "bound_name",
    "covered",
    "unsearched",
]
