"""``plan``: the cut of the units into stages, the placement and the schedule, chosen together.

1. Price cuts (``search.Cuts``): every cut where there are few enough, else those a local
   search over the solver's per-cut bounds visits from the baselines' cuts and the most
   balanced one. A cut whose parameters, gradients, optimizer state and one microbatch's
   activations exceed the budget on some rank has no schedule and is left out.
2. Solve the baselines (even split, torchtitan's default, Megatron's with the embedding and
   loss counted as layers) with the solver at the same budget.
3. Best first: solve cuts in order of their bound (the solver's heuristics, briefly) and stop
   once the next cut's bound reaches the best value found, or at the time set for this phase.
   A cut that improves the best adds its neighbours.
4. Polish the best few cuts with the full solver (MILP windows where ``milp``) and keep the best
   of them and of the baselines.

The bound returned holds over every cut of the placements searched and every schedule within
the budget: where every cut was priced, the least over feasible cuts of the best bound known
for each (the solver's where it solved the cut, its quick bound otherwise); elsewhere the
placement's ``relaxed_bound``. Every value is the simulator's on the composed stage costs.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

from ..errors import ZbError
from ..formats.edit import updated
from ..formats.layers import LayerProfile
from ..formats.partition import CutOutcome, Partition
from ..formats.schedule import Schedule
from ..solver import Progress, SolveResult, solve
from .baselines import baseline_cuts
from .compose import Cut, Placement
from .memory import OPTIMIZERS
from .search import CutEval, Cuts, compositions, relaxed_bound

__all__ = ["PlanResult", "plan", "ENUMERATE"]

# Cuts of a placement priced one by one when there are at most this many (12 units on 8
# stages: 330); beyond, the local search. Each costs a quick bound: milliseconds.
ENUMERATE = 3000
# Shares of the time limit: pricing cuts, solving the baselines, best-first quick solves; the
# rest polishes the best cuts.
_PRICE, _BASELINES, _QUICK = 0.15, 0.2, 0.35
# Cuts polished with the full solver at the end, and how close to the best a quick value must be.
_POLISH, _POLISH_WITHIN = 3, 0.03


@dataclass
class PlanResult:
    """What ``plan`` returns: the schedule (with its ``partition`` section) and how it was found."""

    schedule: Schedule
    partition: Partition
    cut: Cut

    def __repr__(self) -> str:
        p = self.partition
        return (f"PlanResult({self.cut}, value={p.value:.6g} ms, bound={p.lower_bound:.6g} ms, gap={p.gap:.2%}, "
                f"{p.cuts_solved} cuts solved)")


def plan(
    layers: LayerProfile,
    num_ranks: int,
    num_microbatches: int,
    budget: float | None,
    *,
    placement: str = "auto",
    optimizer: str = "adamw",
    time_limit: float = 60.0,
    objective: str = "span",
    milp: bool = True,
    progress: Progress | None = None,
) -> PlanResult:
    """The best cut, placement and schedule found within ``time_limit`` seconds.

    Args:
        layers: the per-layer profile.
        num_ranks: pipeline ranks P.
        num_microbatches: microbatches per iteration.
        budget: bytes per rank for parameters, gradients, optimizer state and activations (None:
            unlimited).
        placement: ``one`` (P stages), ``v`` (2P pieces in a V) or ``auto`` (both).
        optimizer: what the static memory counts (``zbsearch.planner.memory``).
        objective: ``span`` or ``makespan``, as for ``solve``.
        milp: polish with the solver's MILP windows.

    Raises:
        ZbError: bad arguments, or no cut whose memory fits the budget.
    """
    t0 = time.monotonic()
    m = num_microbatches
    places = _placements(placement, layers, num_ranks)
    if optimizer not in OPTIMIZERS:
        raise ZbError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if m < 1:
        raise ZbError("the number of microbatches must be at least 1")
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ZbError("the memory budget must be a positive number of bytes")
    if objective not in ("span", "makespan"):
        raise ZbError(f"objective must be 'span' or 'makespan', not {objective!r}")
    best_value = math.inf
    bound_now = 0.0

    def report(phase: str) -> None:
        if progress is not None:
            progress(phase, best_value, bound_now)

    # 1. price cuts
    spaces = {pl: Cuts(layers, num_ranks, pl, m, budget, optimizer, objective) for pl in places}
    price_until = t0 + _PRICE * time_limit
    exhaustive: dict[Placement, bool] = {}
    report("pricing cuts")
    for pl, space in spaces.items():
        share = t0 + (list(spaces).index(pl) + 1) * _PRICE * time_limit / len(spaces)
        if space.total <= ENUMERATE:
            for counts in compositions(layers.num_units, space.num_stages):
                space.evaluate(counts)
            exhaustive[pl] = True
        else:
            starts = [b.cut.counts for b in baseline_cuts(layers, num_ranks, pl) if b.cut is not None]
            starts.append(space.balanced())
            for start in dict.fromkeys(starts):
                space.descend(start, min(share, price_until))
            exhaustive[pl] = False
    feasible = [ev for space in spaces.values() for ev in space.seen.values() if ev.feasible]
    if not feasible:
        raise ZbError(_no_fit(spaces, budget, optimizer))

    # 2. baselines at the same budget
    outcomes: list[CutOutcome] = []
    base_runs: list[tuple[CutEval, SolveResult]] = []
    rules = [(pl, b) for pl in places for b in baseline_cuts(layers, num_ranks, pl)]
    runnable = [(pl, b) for pl, b in rules if b.cut is not None and spaces[pl].evaluate(b.cut.counts).feasible]
    per_base = max(0.2, _BASELINES * time_limit / max(1, len(runnable)))
    for pl, b in rules:
        name = b.name if len(places) == 1 else f"{b.name} ({pl})"
        if b.cut is None:
            outcomes.append(CutOutcome(name=name, placement=pl, units_per_stage=[], layers_per_stage=[], note=b.note))
            continue
        ev = spaces[pl].evaluate(b.cut.counts)
        if not ev.feasible:
            outcomes.append(_outcome(name, layers, ev, None, f"over the budget: a rank needs {ev.over:.4g} bytes more "
                                                             "than it has, for one microbatch's activations"))
            continue
        report(f"solving baseline {name}")
        res = _solve(ev, m, per_base, milp, objective)
        if res is None:
            outcomes.append(_outcome(name, layers, ev, None, "no schedule within the budget"))
            continue
        base_runs.append((ev, res))
        outcomes.append(_outcome(name, layers, ev, res, None))
        best_value = min(best_value, res.info.value)

    # 3. best first, quick solves
    quick_until = time.monotonic() + _QUICK * time_limit
    results: dict[tuple[Placement, tuple[int, ...]], SolveResult] = {}
    for ev, res in base_runs:
        results[(ev.cut.placement, ev.cut.counts)] = res
    heap = [(ev.key, str(ev.cut), ev) for ev in feasible]
    heapq.heapify(heap)
    quick_t = _quick_time(feasible[0], m, time_limit)
    solved_keys: set[tuple[Placement, tuple[int, ...]]] = set(results)
    while heap and time.monotonic() < quick_until:
        key, _, ev = heapq.heappop(heap)
        if key >= best_value * (1 - 1e-9):
            heapq.heappush(heap, (key, str(ev.cut), ev))
            break
        ident = (ev.cut.placement, ev.cut.counts)
        if ident in solved_keys:
            continue
        solved_keys.add(ident)
        report(f"solving {ev.cut}")
        res = _solve(ev, m, quick_t, False, objective)
        if res is None:
            continue
        results[ident] = res
        if res.info.value < best_value:
            best_value = res.info.value
            space = spaces[ev.cut.placement]
            for nb in space.neighbours(ev.cut.counts, (1,)):
                nev = space.evaluate(nb)
                if nev.feasible and (nev.cut.placement, nb) not in solved_keys:
                    heapq.heappush(heap, (nev.key, str(nev.cut), nev))

    # 4. polish the best few with the full solver
    ranked = sorted(results.items(), key=lambda kv: kv[1].info.value)
    top = [kv for kv in ranked if kv[1].info.value <= ranked[0][1].info.value * (1 + _POLISH_WITHIN)][:_POLISH]
    polish_s = max(0.0, t0 + time_limit - time.monotonic())
    for i, (ident, res) in enumerate(top):
        left = t0 + time_limit - time.monotonic()
        share = left / (len(top) - i)
        if share < 0.2 and i:
            break
        ev = spaces[ident[0]].evaluate(ident[1])
        report(f"polishing {ev.cut}")
        better = _solve(ev, m, max(share, 0.2), milp, objective, start=res.schedule.rank_actions)
        if better is not None:
            ev.bound = max(ev.bound, better.info.lower_bound)
            if better.info.value < res.info.value:
                results[ident] = better
    del polish_s

    # choose, and bound every cut
    ident, res = min(results.items(), key=lambda kv: kv[1].info.value)
    for (pl, counts), r in results.items():
        ev = spaces[pl].evaluate(counts)
        ev.bound = max(ev.bound, r.info.lower_bound)
        ev.value = r.info.value if ev.value is None else min(ev.value, r.info.value)
    bounds = []
    for pl, space in spaces.items():
        if exhaustive[pl]:
            bounds.append(min((ev.bound for ev in space.seen.values() if ev.feasible), default=math.inf))
        else:
            bounds.append(relaxed_bound(layers, num_ranks, pl, m))
    value = res.info.value
    lower = min(min(bounds), value)
    bound_now = lower
    best_value = value
    report("done")
    ev = spaces[ident[0]].evaluate(ident[1])
    tl = res.timeline
    part = Partition(
        layers=layers.name, units=layers.names, kinds=[u.kind for u in layers.units], placement=ev.cut.placement,
        stages=ev.cut.names(layers), optimizer=optimizer, budget_bytes=budget, static_bytes=ev.static,
        activation_bytes=list(tl.peak_memory), objective=objective, value=value, lower_bound=lower,
        gap=max(0.0, value / lower - 1) if lower > 0 else 0.0, placements_searched=list(places),
        cuts_solved=len(results), cuts_bounded=sum(len(s.seen) for s in spaces.values()),
        exhaustive=all(exhaustive.values()), time_s=round(time.monotonic() - t0, 3), baselines=outcomes,
    )
    sched = updated(res.schedule, partition=part)
    return PlanResult(sched, part, ev.cut)


def _placements(placement: str, layers: LayerProfile, num_ranks: int) -> list[Placement]:
    if num_ranks < 2:
        raise ZbError(f"a pipeline needs at least 2 ranks, not {num_ranks}")
    if placement not in ("one", "v", "auto"):
        raise ZbError(f"placement {placement!r}: use one, v or auto")
    n = layers.num_units
    if placement == "one" or (placement == "auto" and n < 2 * num_ranks):
        if n < num_ranks:
            raise ZbError(f"{n} units cannot fill {num_ranks} stages (one per rank)")
        return ["one"]
    if n < 2 * num_ranks:
        raise ZbError(f"{n} units cannot fill the {2 * num_ranks} pieces of a V on {num_ranks} ranks")
    return ["v"] if placement == "v" else ["one", "v"]


def _quick_time(ev: CutEval, m: int, time_limit: float) -> float:
    """Seconds for one quick solve: enough for the heuristics on this many passes."""
    passes = 3 * len(ev.cut.counts) * m
    return min(max(0.1, passes / 2000), max(0.1, time_limit / 20))


def _solve(ev: CutEval, m: int, seconds: float, milp: bool, objective: str,
           start: list | None = None) -> SolveResult | None:
    """The solver on one cut under its per-rank limits; None where no schedule fits."""
    assert ev.profile is not None
    try:
        res = solve(ev.profile, m, ev.limit, chunks=ev.cut.chunks, time_limit=seconds, milp=milp,
                    objective=objective, start=start)  # type: ignore[arg-type]
    except ZbError:
        return None
    ev.solves.append(res.info.value)
    ev.bound = max(ev.bound, res.info.lower_bound)
    return res


def _outcome(name: str, layers: LayerProfile, ev: CutEval, res: SolveResult | None, note: str | None) -> CutOutcome:
    kinds = [u.kind for u in layers.units]
    per_layer = [sum(k == "layer" for k in kinds[lo:hi]) for lo, hi in ev.cut.bounds]
    return CutOutcome(
        name=name, placement=ev.cut.placement, units_per_stage=list(ev.cut.counts), layers_per_stage=per_layer,
        value=None if res is None else res.info.value, lower_bound=None if res is None else res.info.lower_bound,
        peak_bytes=None if res is None else [s + a for s, a in zip(ev.static, res.timeline.peak_memory)], note=note,
    )


def _no_fit(spaces: dict[Placement, Cuts], budget: float | None, optimizer: str) -> str:
    closest = min((ev for s in spaces.values() for ev in s.seen.values()), key=lambda ev: ev.over)
    need = (budget or 0) + closest.over
    return (f"no cut fits a budget of {(budget or 0) / 2**30:.4g} GiB per rank with {optimizer}: the closest, "
            f"{closest.cut}, needs {need / 2**30:.4g} GiB on some rank for its parameters, gradients, optimizer state "
            f"and one microbatch's activations")
