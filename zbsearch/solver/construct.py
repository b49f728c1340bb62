"""Construction: the best schedule the heuristics build, and runners-up to search from.

Candidates: a given start (the best schedule at a smaller limit, for a monotone frontier), the
list-scheduling grid (``heuristic``) with the wait knobs of its best few policies refined, the
handcrafted orders that apply to the placement (ZB-H1/H2, 1F1B split; ZB-V, and the V
building blocks V-Half and V-Min, which reach below 1F1B's memory; with recomputation, 1F1B and
ZB-H1 recomputing every microbatch, and with recomputation "auto" those of them that need more
memory than the limit checkpointed into it, ``checkpointing``) and the sequential schedule,
which fits every feasible limit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .. import clock
from ..actions import Action
from ..classic import KINDS
from ..errors import ZbError
from ..layout import placement
from ..simulator import Timeline
from .checkpointing import checkpointed
from .heuristic import Policy, candidate_policies, list_schedule, refine_waits, sequential_schedule
from .problem import Problem

__all__ = ["construct", "classic_candidates", "checkpointed_candidates"]

# The best few list-scheduling policies of distinct structure whose wait knobs are refined.
_REFINED = 3
# Starts for the first local search beyond the exact MILP's size: the best construction and the
# best of up to two other origins. A start whose waits are tightly phased (a refined one) can sit
# in a local optimum that single moves do not leave while a slightly worse one leads further.
_STARTS = 3

# The checkpointed classic orders after the first start only within this share of the time to
# the construction's deadline (each costs a build and a simulation).
_CHECKPOINTED = 0.25

# Handcrafted orders tried as further candidates, by placement; the least bubble first (when time
# is short only the first within the memory limit is timed: ZB-H2 needs about 2p, ZB-H1 1p, ZB-V
# 1p, V-Half about p/2 + 1 microbatches, V-Min about p/3 + 1); with recomputation allowed, the
# classic orders recomputing every microbatch (about one microbatch's activations).
_CLASSIC_CANDIDATES = {1: ("zb-h2", "zb-h1", "1f1b-split"), 2: ("zb-v", "v-half", "v-min")}
_RECOMPUTING = {1: ("zb-h1-recompute", "1f1b-recompute"), 2: ()}


def classic_candidates(problem: Problem) -> tuple[str, ...]:
    """The handcrafted schedules that apply to the placement and the recomputation allowed, as
    further candidates ("full": only those that recompute every microbatch)."""
    c = problem.cost
    chunks = c.num_stages // c.num_ranks
    if chunks not in _CLASSIC_CANDIDATES or list(c.stage_to_rank) != placement(c.num_ranks, chunks, "v"):
        return ()
    recomputing = _RECOMPUTING[chunks] if problem.recompute != "none" else ()
    if problem.recompute == "full":
        return recomputing
    return _CLASSIC_CANDIDATES[chunks] + recomputing


def checkpointed_candidates(problem: Problem) -> tuple[str, ...]:
    """The handcrafted orders that, where they need more memory than the limit, are
    checkpointed into it (``checkpointing``) as further candidates: with recomputation "auto"
    on the placements the classic candidates apply to."""
    if problem.recompute != "auto" or not problem.cost.can_recompute:
        return ()
    kinds = [k for k in classic_candidates(problem) if k not in _RECOMPUTING[1]]
    # the one needing the least memory first (the first to be timed when time is short)
    return tuple(sorted(kinds, key=lambda k: k != "zb-h1"))


def _classic(problem: Problem, kind: str, deadline: float, built: dict | None) -> list[list[Action]]:
    """The classic kind's order on the problem's costs: as ``built`` holds it (built on the same
    costs by an earlier construction of this solve), else built by ``deadline`` and kept there."""
    done = built.get(kind) if built is not None else None
    if done is not None:
        return done[0]
    rows = KINDS[kind].build_by(problem.cost, problem.num_microbatches, deadline)
    if built is not None:
        built[kind] = (rows, None)
    return rows


def _checkpointed(problem: Problem, kind: str, deadline: float, built: dict | None) -> list[list[Action]]:
    rows = _classic(problem, kind, deadline, built)
    if problem.fits_order(rows):
        raise ZbError("fits without recomputation: a classic candidate already")
    out = checkpointed(problem, rows)
    if out is None:
        raise ZbError("cannot be checkpointed into the limit")
    return out


def _same(rows: list[list[Action]]) -> list[list[Action]]:
    return rows


def construct(
    problem: Problem, deadline: float, hard: float, start=None, keep: int = 3, grid: float | None = None,
    report: Callable[[float], None] | None = None, target: float = float("-inf"),
    built: dict[str, tuple[list[list[Action]], Timeline | None]] | None = None, refine: float = 3.0,
    late: float = 0.0, step: float = 0.0,
) -> tuple[str, list[list[Action]], Timeline, float, list[list[list[Action]]], bool]:
    """Best of the checkpointed classic orders (``checkpointed_candidates``, timed first: the
    first before ``hard``, the others within ``_CHECKPOINTED`` of the time to ``deadline``), the
    given start, the list-scheduling grid (ordered most-promising first; ranked by their own
    timing, only the best few simulated; the best ``_REFINED`` structures with their wait knobs
    refined, within the grid's deadline), the classic schedules and the sequential one, as far
    as ``deadline`` allows: once it has passed, the first of these within the limit is kept
    (besides the checkpointed ones); where the next build or simulation would end more than
    ``late`` seconds after it (each taking as long as the longest so far, or ``step``), the
    first schedule in hand is, and little more is built (of the classic orders not built
    already only the one needing the least memory, the last: on thousands of passes each build
    and simulation takes a large part of a second), then the sequential schedule, which needs
    the least memory of any schedule. Until one list
    schedule is found the grid runs to ``hard`` (the solve's deadline less what its end needs),
    where a list schedule still running is cut. ``grid``:
    when the grid stops once one list schedule is found (default ``deadline``). ``report``
    hears each better list schedule's value by its own timing (never below its simulated
    value), as soon as it is built. The refinement stops once a list schedule reaches
    ``target`` (a lower bound: nothing better exists). Also returns the runners-up (up to
    ``_STARTS - 1``: the best simulated candidate within the limit of each other origin, best
    first): further starts for the local search. ``built``: the classic schedules built on these costs, by kind, with their
    timelines where simulated (None: over the limit, or not simulated); those it holds are
    reused, those built here are added.
    ``refine``: the refinement takes at most this many times as long as the grid took. Last,
    whether a deadline left some of this work undone."""
    # The checkpointed classic orders first, while time is fresh: cheap to build, and where the
    # limit binds hard often better than any list schedule (timed whatever the grid leaves).
    timed: list[tuple[float, str, list[list[Action]], Timeline, str]] = []
    sim_s = 0.0
    cut = False
    # the longest one build or simulation has taken (here, or ``step`` before): what the next may take
    began = clock.now()
    until = began + _CHECKPOINTED * (deadline - began)
    for kind in checkpointed_candidates(problem):
        if timed and clock.now() > until or clock.now() > hard:
            cut = True
            break
        tick = clock.now()
        try:
            rows = _checkpointed(problem, kind, hard, built)
        except ZbError:
            continue
        finally:
            step = max(step, clock.now() - tick)
        tick = clock.now()
        value, tl = problem.evaluate(rows)
        sim_s = max(sim_s, clock.now() - tick)
        if problem.fits(tl):
            if report is not None and all(value < v for v, *_ in timed):
                report(value)
            timed.append((value, f"{kind}, checkpointed", rows, tl, "checkpointed"))
    found: list[tuple[float, str, list[list[Action]], Policy]] = []
    began = clock.now()
    for policy in candidate_policies(problem):
        until = (deadline if grid is None else grid) if found else hard
        if clock.now() > until:
            cut = True
            break
        out = list_schedule(problem, policy, until)
        if out is not None:
            if report is not None and all(out[1] < v for v, _, _, _ in found):
                report(out[1])
            found.append((out[1], policy.name, out[0], policy))
        else:  # stuck on memory, or still running at ``until``
            cut |= clock.now() > until
    found.sort(key=lambda x: x[0])
    # The best few policies of distinct structure (depth, lag, fit), their wait knobs refined
    # over every value that changes the schedule: the grid samples them at a few points only.
    # Their schedules are candidates next to the grid's best, not instead of them: the grid's
    # are often better starts for the local search (their waits are less tightly phased).
    phase = (deadline if grid is None else grid) if found else hard
    until = min(phase, clock.now() + refine * (clock.now() - began))
    refined: list[tuple[float, str, list[list[Action]]]] = []
    structures: set[tuple] = set()
    for value, _, _, policy in found:
        shape = (policy.depth, policy.lag, policy.fit, policy.fuse)
        so_far = min([found[0][0]] + [v for v, _, _ in refined])
        if len(structures) == _REFINED or shape in structures or so_far <= target:
            continue
        if clock.now() > until:
            cut |= until == phase  # (its own share, ``refine``, is no share of the time limit)
            continue
        structures.add(shape)
        better = refine_waits(problem, policy, value, until, target)
        cut |= until == phase and clock.now() > until  # its sweep of the knobs stops there
        if better is not None:
            if report is not None and better[2] < so_far:
                report(better[2])
            refined.append((better[2], better[0].name, better[1]))
    refined.sort(key=lambda x: x[0])
    # the given start first: within a smaller limit, it is what makes results monotone in memory
    given = start
    # (origin, name, builder): the origin tells the runners-up apart (see below)
    cands: list[tuple[str, str, Callable[[], list[list[Action]]]]] = []
    if given is not None:
        cands.append(("given", "given", lambda: given))
    cands += [("refined", name, functools.partial(_same, rows)) for _, name, rows in refined[:keep]]
    cands += [("grid", name, functools.partial(_same, rows)) for _, name, rows, _ in found[:keep]]
    for kind in classic_candidates(problem):
        cands.append(("classic", kind, functools.partial(_classic, problem, kind, deadline, built)))
    cands.append(("sequential", "sequential", lambda: sequential_schedule(problem)))
    thrifty = classic_candidates(problem)[-1:]  # the classic order needing the least memory
    early = len(timed)
    for origin, name, build in cands:
        now = clock.now()
        step = max(step, sim_s)
        if now + step > deadline + late and now > deadline and (
                timed or origin == "classic" and name not in thrifty and (built is None or name not in built)):
            cut = True  # past the deadline and the next step would end past ``late``: keep what is in hand
            if timed:
                break
            continue
        if now > deadline and len(timed) > early:
            cut = True
            break
        tick = clock.now()
        try:
            rows = build()
        except ZbError:  # the kind does not apply here (e.g. DualPipeV below 2p microbatches)
            continue
        finally:
            step = max(step, clock.now() - tick)
        cut |= origin == "classic" and clock.now() > deadline  # (ZB-V repeats its construction until then)
        if not problem.fits_order(rows) or not problem.complete_recomputation(rows):
            continue  # over the limit (e.g. ZB-H2 at 1p), or not recomputing as asked: no need to time it
        tick = clock.now()
        value, tl = problem.evaluate(rows)
        sim_s = max(sim_s, clock.now() - tick)
        if origin == "classic" and built is not None:
            built[name] = (rows, tl)
        if problem.fits(tl):
            timed.append((value, name, rows, tl, origin))
    assert timed  # the sequential schedule fits every limit check_limit accepts
    timed.sort(key=lambda x: x[0])  # stable: of equal values the earlier candidate
    best = timed[0]
    # runners-up: the best of each other origin (a refined list schedule, the grid's, a classic
    # one...), which tend to lie in other basins of the local search than the best
    others: list[list[list[Action]]] = []
    origins = {best[4]}
    for _, _, rows, _, origin in timed[1:]:
        if len(others) < _STARTS - 1 and origin not in origins and rows != best[2]:
            origins.add(origin)
            others.append(rows)
    return best[1], best[2], best[3], sim_s, others, cut
