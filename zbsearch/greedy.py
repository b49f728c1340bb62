"""Greedy list scheduler: B first, F while activations fit under the limit, W to fill.

The plain policy of the solver's list scheduler (``zbsearch.solver.heuristic``), which
documents the rules, the memory reservation that keeps several chunks per rank from
deadlocking, and the other policies the solver tries. Costs are the real per-stage costs.
"""

from __future__ import annotations

from .actions import Action
from .costs import CostModel
from .errors import ZbError
from .solver.heuristic import Policy, list_schedule
from .solver.problem import Problem

__all__ = ["greedy_schedule"]


def greedy_schedule(cost: CostModel, num_microbatches: int, memory_limit: list[float] | None = None) -> list[list[Action]]:
    out = list_schedule(Problem(cost, num_microbatches, None if memory_limit is None else tuple(memory_limit)), Policy())
    if out is None:
        raise ZbError("memory limit too small for the greedy schedule: every rank is blocked waiting for memory")
    return out[0]
