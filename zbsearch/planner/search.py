"""The cuts of one placement: each priced by a bound, the feasible ones found, the best searched.

For a cut, ``CutEval`` holds its stage profile, its per-rank activation limit (the budget less
parameters, gradients and optimizer state) and its *key*: the solver's quick lower bound for
that cut under that limit (``zbsearch.bounds``: per rank, the one-machine, memory or area
and deferral bounds, and with recomputation the relay bound's LP relaxation), valid for every schedule of the cut. The
planner solves cuts in order of their key and stops once the next key reaches the best value
found: no cut left can beat it.

Which cuts: every one where there are few enough (``comb(N - 1, S - 1)`` for N units on S
stages); otherwise a local search over cuts from the baselines' and the most balanced one,
moving one stage boundary at a time while the per-rank bounds, sorted from the largest, get
smaller (a plateau of equal largest bounds is left by the next largest).

With recomputation (``auto``, ``full``) a cut's memory need is what a microbatch keeps
checkpointed (``compose.activation_need``), its key the bounds that hold for every choice of
which microbatches to recompute (the area bound replaces the memory bound that assumes none).
Each rank's bound also takes ``relaxation.RankBounds``' (its work, recompute passes counted,
and the fill time its forwards cannot cover).

Where a placement has too many cuts to price, ``relaxation.relaxed_bound`` bounds them all at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .. import clock as timing
from ..bounds import (
    makespan_from_spans,
    rank_area_span_lower_bounds,
    rank_deferral_span_lower_bounds,
    rank_iteration_lower_bounds,
    rank_memory_span_lower_bounds,
    rank_relay_span_lower_bounds,
    rank_span_lower_bounds,
)
from ..costs import CostModel
from ..formats.layers import LayerProfile
from ..formats.profile import LaneSharing, Profile
from ..limits import allowance
from ..solver import SolveResult
from ..solver.problem import Problem
from .compose import Cut, Placement, activation_need, stage_profile, static_bytes
from .relaxation import RankBounds, min_max_cut, unit_work

__all__ = ["CutEval", "Cuts", "compositions"]


@dataclass
class CutEval:
    """One cut, priced: feasible under the budget or not, and its bound."""

    cut: Cut
    static: list[float]  # per rank: parameters, gradients, optimizer state (bytes)
    limit: list[float] | None  # per rank: what activations may hold (None: no budget)
    feasible: bool
    over: float = 0.0  # the most any rank's least memory exceeds the budget (bytes; <= 0 when it fits)
    profile: Profile | None = None
    key: float = math.inf  # the solver's quick bound for this cut (ms); inf when infeasible
    ranks: tuple[float, ...] = ()  # per-rank bounds, largest first (ties broken by the next)
    bound: float = 0.0  # the best bound known for this cut: the key, or a solver's if larger
    solved: bool = False  # whether the solver ran on it
    result: SolveResult | None = None  # its best schedule found


def compositions(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut ``n`` units into ``parts`` non-empty consecutive groups."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


class Cuts:
    """The cuts of ``layers`` on ``num_ranks`` ranks under one placement, priced on demand."""

    def __init__(self, layers: LayerProfile, num_ranks: int, placement: Placement, m: int, budget: float | None,
                 optimizer: str, objective: str, recompute: str = "none",
                 data_parallel: tuple[int, float] | None = None, shard: int | None = None,
                 sharing: LaneSharing | None = None) -> None:
        self.layers, self.num_ranks, self.placement, self.m = layers, num_ranks, placement, m
        self.budget, self.optimizer, self.objective, self.recompute = budget, optimizer, objective, recompute
        self.data_parallel, self.shard, self.sharing = data_parallel, shard, sharing
        self.num_stages = num_ranks * (2 if placement == "v" else 1)
        self.seen: dict[tuple[int, ...], CutEval] = {}
        self.exhaustive = False  # whether every cut was priced
        self.rank_bounds = RankBounds(layers, num_ranks, placement, m, recompute, budget, optimizer, shard=shard)

    @property
    def total(self) -> int:
        """How many cuts there are."""
        return math.comb(self.layers.num_units - 1, self.num_stages - 1)

    def evaluate(self, counts: tuple[int, ...]) -> CutEval:
        """The cut's evaluation (cached): static memory, limits, feasibility and key."""
        got = self.seen.get(counts)
        if got is not None:
            return got
        cut = Cut(counts, self.placement)
        static = static_bytes(self.layers, cut, self.optimizer, self.shard)
        limit = None if self.budget is None else [self.budget - s for s in static]
        need = activation_need(self.layers, cut, self.recompute)
        feasible = limit is None or all(x > 0 and n <= allowance(x) for n, x in zip(need, limit))
        over = -math.inf if limit is None else max(n - x for n, x in zip(need, limit))
        ev = CutEval(cut, static, limit, feasible, over)
        if feasible:
            ev.profile = stage_profile(self.layers, cut, self.data_parallel, sharded=self.shard is not None,
                                       sharing=self.sharing)
            # the costs the solver sees: only the recomputation this plan allows
            problem = Problem.make(CostModel.from_profile(ev.profile, cut.stage_to_rank), self.m,
                                   objective=self.objective, recompute=self.recompute)  # type: ignore[arg-type]
            cost = problem.cost
            ranks = rank_span_lower_bounds(cost, self.m)
            if limit is not None:  # the memory-aware bounds that hold for every recomputation choice
                memory = rank_area_span_lower_bounds if cost.can_recompute else rank_memory_span_lower_bounds
                # with recomputation, the relay bound's LP relaxation too (a program per rank and set
                # of its stages; in whole microbatches several times the area bound's time): a solve
                # of the cut proves more
                relay = (rank_relay_span_lower_bounds(cost, self.m, limit, whole=False) if cost.can_recompute
                         else [0.0] * cost.num_ranks)
                ranks = [max(a, b, c, d) for a, b, c, d in zip(ranks, memory(cost, self.m, limit),
                                                                rank_deferral_span_lower_bounds(cost, self.m, limit), relay)]
            # each rank's work and the fill its forwards cannot cover, recompute passes counted
            ranks = [max(a, b) for a, b in zip(ranks, self.rank_bounds.of_cut(counts))]
            ev.ranks = tuple(sorted(ranks, reverse=True))
            # the makespan: per rank, its span's bound after the forwards of one microbatch reach it;
            # the iteration: per rank, the least its reductions let it end (``bounds.rank_iteration_lower_bounds``)
            ev.key = (makespan_from_spans(cost, self.m, ranks) if self.objective == "makespan"
                      else max(rank_iteration_lower_bounds(cost, self.m, ranks)) if problem.objective == "iteration"
                      else max(ranks))
            ev.bound = ev.key
        self.seen[counts] = ev
        return ev

    def price_all(self, deadline: float, now: Callable[[], float] = timing.now) -> bool:
        """Price every cut, in order, until ``deadline`` (on the clock ``now``; the first cut
        whatever the time); whether all were (``exhaustive``)."""
        for k, counts in enumerate(compositions(self.layers.num_units, self.num_stages)):
            if k and now() >= deadline:
                return False
            self.evaluate(counts)
        self.exhaustive = True
        return True

    def neighbours(self, counts: tuple[int, ...], steps: tuple[int, ...] = (1, 2)) -> Iterator[tuple[int, ...]]:
        """The cuts with one stage boundary moved by one of ``steps`` units either way."""
        for b in range(len(counts) - 1):
            for d in steps:
                for sign in (1, -1):
                    left, right = counts[b] + sign * d, counts[b + 1] - sign * d
                    if left >= 1 and right >= 1:
                        yield counts[:b] + (left, right) + counts[b + 2:]

    def descend(self, start: tuple[int, ...], deadline: float, now: Callable[[], float] = timing.now) -> CutEval:
        """Local search from ``start`` until ``deadline`` (on the clock ``now``): the best
        neighbour while it improves the per-rank bounds (largest first); infeasible cuts are
        left behind as soon as a feasible one is found."""
        cur = self.evaluate(start)
        while now() < deadline:
            best = cur
            for nb in self.neighbours(cur.cut.counts):
                ev = self.evaluate(nb)
                if _better(ev, best):
                    best = ev
                if now() >= deadline:
                    break
            if best is cur:
                break
            cur = best
        return cur

    def balanced(self) -> tuple[int, ...]:
        """The cut whose busiest stage computes least (each unit at its cheapest passes), by
        dynamic programming; ties go to the cut with later boundaries."""
        return min_max_cut(unit_work(self.layers, self.recompute), self.num_stages)


def _better(a: CutEval, b: CutEval) -> bool:
    """Whether ``a`` is a better cut to search from than ``b``: feasible first, then smaller
    per-rank bounds (largest first), then less static memory on the fullest rank."""
    if a.feasible != b.feasible:
        return a.feasible
    if not a.feasible:
        return a.over < b.over  # nearer to fitting
    if a.ranks != b.ranks:
        return a.ranks < b.ranks
    return max(a.static) < max(b.static)
