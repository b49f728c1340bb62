"""The W passes of a rank holding several stages, ordered for the reduction lane.

A stage's reduction starts when its last W (or BW) of the step has run on its rank, and the
rank's lane runs its reductions one at a time (``zbsearch.reductions``). On a rank with two
stages (the V) the iteration ends at the span plus one reduction when the rank's last passes
belong to one stage only, at least as long as the other stage's reduction: that one then runs
beside them. A span-optimal schedule mixes the two stages' W passes in the drain, and moving
one W at a time rarely pays (the objective is the slowest rank's, and every rank needs several
moves).

``order_for_lane`` keeps every pass where it is and re-assigns the W passes among the slots
they hold on a rank: going through the slots in order, each takes the next W (in microbatch
order) of the first stage in a preference order whose B has run by then, so the preferred
stages finish their W passes as early as the slots allow and the last stage's fill the end.
Some W is always ready: the slots held as many W passes of each stage, each after its B, and
the preference only moves a stage's W passes earlier, which leaves the others' later. A
choice of the last stage stays where the schedule's iteration, or failing that the sum of its
ranks' iterations, gets shorter, timed by the core simulator within the memory limit (a W of
another stage may free other memory). A simulation covers every rank: the ranks are first
tried all at once, then rank by rank. Fused backwards (BW) stay where they are.
"""

from __future__ import annotations

from .. import clock
from ..actions import Action, Op
from ..tolerances import REL_TOL
from .problem import Problem

__all__ = ["order_for_lane"]


def _slots(row: list[Action], preference: list[int]) -> list[Action]:
    """``row`` with its W slots re-assigned: each to the next ready W of the first stage in
    ``preference`` that has one (module docstring)."""
    queued = {s: sorted(a.mb for a in row if a.op is Op.W and a.stage == s) for s in preference}
    taken = {s: 0 for s in preference}
    done_b: dict[int, set[int]] = {s: set() for s in preference}
    out = list(row)
    for i, a in enumerate(row):
        if a.op is Op.B:
            done_b[a.stage].add(a.mb)
        elif a.op is Op.W:
            for s in preference:
                k = taken[s]
                if k < len(queued[s]) and queued[s][k] in done_b[s]:
                    out[i] = Action(s, Op.W, queued[s][k])
                    taken[s] = k + 1
                    break
            else:  # no W ready (the module docstring says why not): keep the row as it was
                return row
    return out


def order_for_lane(problem: Problem, rows: list[list[Action]], deadline: float = float("inf")) -> list[list[Action]]:
    """``rows`` with each multi-stage rank's W passes ordered for its reductions where that
    shortens the iteration (module docstring); ``rows`` itself where nothing does. First every
    rank at once with its k-th stage last, for each k, and each rank with the best of those for
    it; then rank by rank, each stage last in turn. Stops trying at ``deadline``
    (``deadline.now()``), keeping what it found."""
    cost = problem.cost
    if problem.objective != "iteration" or not cost.has_reductions:
        return rows
    value, tl = problem.evaluate(rows)
    if not problem.fits(tl):
        return rows
    allowed = problem.allowed()
    multi = [r for r in range(cost.num_ranks) if len(cost.rank_stages(r)) > 1]
    best, score = rows, (value, sum(tl.iteration))

    def tried(cand: list[list[Action]]):
        """The candidate's timeline; it becomes the best where it fits and is better."""
        nonlocal best, score
        v, t = problem.evaluate(cand)
        got = (v, sum(t.iteration))
        tol = REL_TOL * max(1.0, abs(score[0]))
        if problem.fits(t) and (got[0] < score[0] - tol or (got[0] <= score[0] + tol and got[1] < score[1] - tol)):
            best, score = cand, got
        return t

    def reordered(row: list[Action], stages: list[int], last: int) -> list[Action]:
        return _slots(row, [s for s in stages if s != last] + [last])

    # every rank at once, then each rank's best
    own = {r: (tl.iteration[r], rows[r]) for r in multi}
    for k in range(max((len(cost.rank_stages(r)) for r in multi), default=0)):
        if clock.now() >= deadline:
            return best
        cand = [reordered(row, cost.rank_stages(r), cost.rank_stages(r)[k]) if r in own and k < len(cost.rank_stages(r))
                else row for r, row in enumerate(rows)]
        t = tried(cand)
        for r in multi:
            if t.iteration[r] < own[r][0] and t.peak_memory[r] <= allowed[r]:
                own[r] = (t.iteration[r], cand[r])
    mixed = [own[r][1] if r in own else row for r, row in enumerate(rows)]
    if mixed != best and clock.now() < deadline:
        tried(mixed)
    # rank by rank from the best
    for r in multi:
        stages = cost.rank_stages(r)
        for last in stages:
            if clock.now() >= deadline:
                return best
            row = reordered(best[r], stages, last)
            if row != best[r]:
                cand = list(best)
                cand[r] = row
                tried(cand)
    return best
