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

import math

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


# ---------------------------------------------------------------------------------------------
# Memory-aware bounds. The bounds above ignore memory; under a tight limit (ZB-1p) a rank must
# also wait for activations to be freed, which these bounds count.


def _max_forward_work(cost: CostModel, stages: list[int], budget: float, m: int) -> float:
    """Most F time a rank can run without freeing memory: a fractional knapsack over its
    stages (at most m F passes each, m_f memory each), an upper bound on any integer choice."""
    work = 0.0
    for s in sorted(stages, key=lambda s: -cost.t_f[s] / cost.m_f[s] if cost.m_f[s] > 0 else float("-inf")):
        n = m if cost.m_f[s] <= 0 else min(m, budget / cost.m_f[s])
        work += n * cost.t_f[s]
        budget -= n * max(cost.m_f[s], 0.0)
    return work


def _end_idle(cost: CostModel, s: int, lag: float, m: int, limit: float) -> float:
    """Idle time a single-stage rank cannot avoid after its last F (see rank_memory_span_lower_bounds)."""
    keep = cost.m_f[s] + cost.m_b[s]  # held by a microbatch between its B and its W
    net = keep + cost.m_w[s]  # left behind by a finished microbatch (0 for a balanced profile)
    gap = lag - cost.t_f[s]
    best = float("inf")
    for a in range(1, m + 1):  # microbatches holding activations after the last F
        base = a * cost.m_f[s] + (m - a) * net
        if base > limit:
            continue
        room = keep - net
        b = m - a if room <= 0 else min(m - a, int((limit - base) // room))
        best = min(best, max(0.0, gap - (a - 1) * (cost.t_b[s] + cost.t_w[s]) - b * cost.t_w[s]))
    return 0.0 if best == float("inf") else best


def _memory_path(cost: CostModel, s: int, lag: float, m: int, limit: float) -> float:
    """Longest path through one single-stage rank's passes when memory orders them (see
    rank_memory_span_lower_bounds); 0 when a pass allocates in B or W (no closed form)."""
    mf, mb, mw = cost.m_f[s], cost.m_b[s], cost.m_w[s]
    if mb > 0 or mw > 0:
        return 0.0
    tf, tb, tw = cost.t_f[s], cost.t_b[s], cost.t_w[s]
    sf = sb = sw = float("-inf")
    end_b, end_w = [], []
    for j in range(m):
        # F(j) needs n_b earlier B passes done (every W done too at best) and n_w earlier W
        # passes done (every B done at best) for memory to stay within the limit.
        need = (j + 1) * mf - limit
        n_b = 0 if need <= 0 else (math.ceil(need / -(mb + mw) - 1e-9) if mb + mw < 0 else j + 1)
        n_w = 0 if need + j * mb <= 0 else (math.ceil((need + j * mb) / -mw - 1e-9) if mw < 0 else j + 1)
        if n_b > j or n_w > j:
            return float("inf")  # memory cannot hold even this: no schedule exists
        sf = max(0.0 if j == 0 else sf + tf, end_b[n_b - 1] if n_b else 0.0, end_w[n_w - 1] if n_w else 0.0)
        sb = max(sf + lag, sb + tb)
        sw = max(sb + tb, sw + tw)
        end_b.append(sb + tb)
        end_w.append(sw + tw)
    return max(end_b[-1], end_w[-1])


def rank_memory_span_lower_bounds(cost: CostModel, num_microbatches: int, limit: list[float]) -> list[float]:
    """Per rank, a lower bound on its span for schedules whose memory stays within ``limit``.

    Rank r with first stage s0 starts with some F(s0, j) at t0. Its first B, of any microbatch
    and stage, cannot start before t0 + lag, lag = the shortest dependency path from an F on
    s0 to a B on the rank (all of one microbatch's passes on later stages). Until then the rank
    can run F passes only, and since nothing frees memory before a B, their activations add
    up to at most the limit: a knapsack bounds their time by Fmax. So the rank idles at least
    ``lag - Fmax`` at the start.

    For a rank with one stage s, let F* be its last F, of microbatch j. B(s, j) cannot start
    before lag after F* starts. In between, the rank can only run B of the a - 1 other
    microbatches whose B is pending and W of those and of the b microbatches whose W is
    pending; memory after F* is a*m_f + b*(m_f + m_b) + (m - a - b)*(net per finished
    microbatch) <= limit. So the rank idles at least min over feasible (a, b) of
    ``lag - T_F - (a-1)(T_B + T_W) - b*T_W`` at the end. If the memory cannot hold all m
    microbatches' activations, some B runs before F*, the two idle periods are disjoint and
    add up; otherwise the larger one counts. The span is at least busy time plus idle time.

    Also, for a single-stage rank: passes of one kind run in microbatch order without loss
    of generality (``zbsearch.solver.problem``), so memory after F(j) is (j+1)*m_f +
    n_B*m_b + n_W*m_w with n_B, n_W the B and W passes before it. With m_b, m_w <= 0 this
    forces B(n_B - 1) and W(n_W - 1) before F(j) for the least n_B, n_W that can satisfy the
    limit. Those precedences, the lag from each F to its B and the order within each kind
    form a graph whose longest path bounds the span; at the smallest limit it is exactly the
    sequential schedule's span.
    Communication delays enter through the dependency path, as in the bounds above.
    """
    m = num_microbatches
    preds = _edges(cost)
    out = []
    for r in range(cost.num_ranks):
        stages = cost.rank_stages(r)
        lim = limit[r] * (1 + 1e-9) + 1e-12  # what the validator accepts
        rel = _releases(cost, (min(stages), Op.F), preds)
        lag = min(rel[(s, Op.B)] for s in stages)
        start = max(0.0, lag - _max_forward_work(cost, stages, lim, m))
        end = _end_idle(cost, stages[0], lag, m, lim) if len(stages) == 1 else 0.0
        all_forwards = m * sum(max(cost.m_f[s], 0.0) for s in stages)
        idle = start + end if all_forwards > lim else max(start, end)
        path = _memory_path(cost, stages[0], lag, m, lim) if len(stages) == 1 else 0.0
        out.append(max(cost.rank_busy(r, m) + idle, path))
    return out


def memory_span_lower_bound(cost: CostModel, num_microbatches: int, limit: list[float] | None) -> float:
    """Lower bound on max over ranks of the span, for schedules within ``limit`` (None: no limit)."""
    base = rank_span_lower_bounds(cost, num_microbatches)
    if limit is None:
        return max(base)
    mem = rank_memory_span_lower_bounds(cost, num_microbatches, limit)
    return max(max(a, b) for a, b in zip(base, mem))


def memory_makespan_lower_bound(cost: CostModel, num_microbatches: int, limit: list[float] | None) -> float:
    """Lower bound on the makespan within ``limit``: rank r cannot start before the forwards of
    one microbatch reach it, and then needs at least its memory-aware span."""
    best = makespan_lower_bound(cost, num_microbatches)
    if limit is None:
        return best
    preds = _edges(cost)
    rel = _releases(cost, (0, Op.F), preds)
    for r, span in enumerate(rank_memory_span_lower_bounds(cost, num_microbatches, limit)):
        best = max(best, rel[(min(cost.rank_stages(r)), Op.F)] + span)
    return best
