"""Lower bounds on span and makespan, valid for every schedule of a profile.

Each rank is a single machine that must process m copies of each of its pass types. A pass
of microbatch j cannot start before the rank's first pass of j has started plus the longest
dependency path between the two (its *release*), and once it ends, the dependency chain
still needs some time before the rank's last pass of j can end (its *tail*). The first pass a
rank runs for any microbatch is the forward of its lowest stage, so relative to the rank's
first start every pass of type t is released no earlier than rel(t). For any set J of pass
types, the rank's span is then at least

    min_{t in J} rel(t) + m * sum_{t in J} time(t) + min_{t in J} tail(t)

(Carlier's one-machine bound). We maximise over the sets cut out by a release threshold and a
tail threshold, which contains the best set for this bound. J = all types gives the busy
time; J = {B, W} on rank 0 gives the pipeline's fill time plus all backward work.
The makespan bound is the same with releases measured from the global start and tails up to
the last pass anywhere. Communication is a latency on dependency edges between ranks, as in
the simulator. Splitting or fusing B and W cannot beat these bounds, so they also hold for
schedules with fused BW passes.
"""

from __future__ import annotations

from .actions import Op
from .costs import CostModel
from .graph import pass_predecessors

__all__ = ["span_lower_bound", "makespan_lower_bound", "rank_span_lower_bounds"]

_NEG = float("-inf")


def _nodes(S: int) -> list[tuple[int, Op]]:
    """One microbatch's passes in a topological order."""
    return [(s, Op.F) for s in range(S)] + [(s, Op.B) for s in reversed(range(S))] + [(s, Op.W) for s in range(S)]


def _edges(cost: CostModel):
    S = cost.num_stages
    preds = {}
    for s, op in _nodes(S):
        preds[(s, op)] = [
            ((ds, dop), cost.comm(ds, s) if ds != s else 0.0) for ds, dop, _ in pass_predecessors(s, op, 0, S)
        ]
    return preds


def _releases(cost: CostModel, source: tuple[int, Op], preds) -> dict:
    """Longest start-to-start path from ``source`` to every pass reachable from it."""
    rel = {n: _NEG for n in preds}
    rel[source] = 0.0
    for n in _nodes(cost.num_stages):
        for d, delay in preds[n]:
            if rel[d] > _NEG:
                rel[n] = max(rel[n], rel[d] + cost.time(d[0], d[1]) + delay)
    return rel


def _tails(cost: CostModel, targets: set, preds) -> dict:
    """Longest end-to-end path from each pass to the end of some pass in ``targets``."""
    tail = {n: (0.0 if n in targets else _NEG) for n in preds}
    for n in reversed(_nodes(cost.num_stages)):
        if tail[n] == _NEG:
            continue
        for d, delay in preds[n]:
            tail[d] = max(tail[d], tail[n] + cost.time(n[0], n[1]) + delay)
    return tail


def _carlier(jobs: list[tuple[float, float, float]], m: int) -> float:
    """max over thresholds of min release + m * total time + min tail, jobs = (rel, time, tail)."""
    best = 0.0
    for theta in {j[0] for j in jobs}:
        for tau in {j[2] for j in jobs}:
            work = sum(t for r, t, q in jobs if r >= theta and q >= tau)
            if work:
                best = max(best, theta + m * work + tau)
    return best


def rank_span_lower_bounds(cost: CostModel, num_microbatches: int) -> list[float]:
    preds = _edges(cost)
    out = []
    for r in range(cost.num_ranks):
        stages = cost.rank_stages(r)
        mine = {(s, op) for s in stages for op in (Op.F, Op.B, Op.W)}
        rel = _releases(cost, (min(stages), Op.F), preds)
        tail = _tails(cost, mine, preds)
        out.append(_carlier([(rel[n], cost.time(*n), tail[n]) for n in mine], num_microbatches))
    return out


def span_lower_bound(cost: CostModel, num_microbatches: int) -> float:
    """Lower bound on max over ranks of (last end - first start) on that rank."""
    return max(rank_span_lower_bounds(cost, num_microbatches))


def makespan_lower_bound(cost: CostModel, num_microbatches: int) -> float:
    """Lower bound on (last end anywhere - first start anywhere)."""
    preds = _edges(cost)
    rel = _releases(cost, (0, Op.F), preds)
    tail = _tails(cost, set(preds), preds)
    best = 0.0
    for r in range(cost.num_ranks):
        mine = [(s, op) for s in cost.rank_stages(r) for op in (Op.F, Op.B, Op.W)]
        best = max(best, _carlier([(rel[n], cost.time(*n), tail[n]) for n in mine], num_microbatches))
    return best
