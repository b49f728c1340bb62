"""Lower bounds on span and makespan, valid for every schedule of a profile.

Each bound holds for the idle relaxation (passes may wait longer than their inputs and rank
need, so a rank may start late) and therefore for every ASAP schedule, FIFO or not. Where an
argument takes passes of one kind in microbatch order, that is the relabelling of
``zbsearch.solver.problem``, which is valid in the idle relaxation (not under ASAP, where it
can move a rank's start: which is why the bounds measure spans from the rank's first start,
whatever it is, never from a fixed time).

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
J may also be pass types of *another* rank q, as long as each is reachable from the rank's
first pass (finite release) and reaches one of the rank's passes (finite tail): rank q is a
machine too, and rank r cannot end before q has done that work and the tail has run. With
J = {F, B} of the last rank this bounds rank 0's span by the fill time to the last stage,
(p-1)(T_F + comm), then m (T_F + T_B) there, then the drain of the last backward down to
rank 0 and its W, (p-1)(T_B + comm) + T_W. Whenever (p-1)(T_F + T_B + 2 comm) + T_W > m T_W
no schedule has zero bubble, at any memory limit (1.5B, p=8, m=24: 4.33% at least).
The makespan bound is the same with releases measured from the global start and tails up to
the last pass anywhere. Communication is a latency on dependency edges between ranks, as in
the simulator. Every bound is computed on ``CostModel.for_bounds``, where B and W cost no more
than a fused BW pass does, so the bounds hold for schedules that fuse, split or mix.

Overlapped pairs. Where the passes hold all-to-all that an overlapped pair can hide, every bound
here is computed on ``CostModel.paired_floor``: each forward and backward at the least time it
can take in a pair, no pairs left to form. Every schedule with pairs maps onto one of those
costs without pairs whose passes end no later, so the bounds hold for schedules with pairs,
as they do for those without (which take longer on the true costs). Without all-to-all,
nothing changes. A pair also ends no sooner than either of its passes would alone, so a
dependency chain takes at least its passes' own times. That gives the *pairing* bound
(``rank_pairing_span_lower_bounds``): a rank's backwards all wait for a chain from its first
stage's forward through the last stage and back, so for that long after its first start it
can run forwards only, which no pair holds. Each of them keeps its all-to-all, and so does a
backward for each of them (a pair takes one forward and one backward, and a rank has as many
of each): the rank's span is at least its least busy time with every pass paired, plus the
least that window can cost, filled with whole forwards, each keeping what a pair would hide
(its all-to-all less the share a pair leaves exposed, ``CostModel.hideable``) and leaving a
backward that keeps its own, and idle time for the rest; within a memory limit, no more
forwards than fit together, since nothing frees memory before the first backward. The
backwards after a rank's last forward, which no pair holds either, add nothing to it: they can
be the ones the window's forwards leave without a partner. Where recompute passes may run it
is left out.

Recomputation. Where the costs offer it, a schedule may checkpoint any microbatch's forward
and recompute it: it holds less memory, and its rank does more work. ``for_bounds`` prices an
F at its cheapest (checkpointed or not) and recompute passes at nothing, so the memory-blind
bounds hold over every choice. The memory-aware ones reason from what a microbatch holds
between its F and its B and are left out where recomputation is offered; the *area* bound
(``rank_area_span_lower_bounds``) takes their place: it weighs what a microbatch holds by how
long it must hold it against the limit times the span, and the recompute passes that free
memory against the time they add; where a rank holds several stages, which of their
microbatches it can hold whole together, and which it must checkpoint so that a later stage's
can be whole. The *deferral* bound (``rank_deferral_span_lower_bounds``)
holds either way: memory caps the W passes a rank can leave for after its last B, so the rest
join its F and B passes in the one-machine bound across ranks. The *relay* bound
(``rank_relay_span_lower_bounds``) holds either way too and reasons across ranks: the area
bound's program on a later rank's *core* (its first forward to its last B), which a rank waits
for between the forwards that reach that rank and the backwards that come back.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from . import clock
from .actions import Op
from .costs import CostModel
from .dependencies import earliest_starts, pass_types, type_graph
from .limits import allowance
from .tolerances import ABS_TOL, REL_TOL

__all__ = [
    "span_lower_bound", "makespan_lower_bound", "rank_span_lower_bounds", "rank_chain_span_lower_bounds",
    "memory_span_lower_bound", "memory_makespan_lower_bound", "memory_iteration_lower_bound", "rank_iteration_lower_bounds",
    "rank_backward_end_lower_bounds", "rank_memory_span_lower_bounds",
    "rank_area_span_lower_bounds", "rank_relay_span_lower_bounds", "rank_deferral_span_lower_bounds", "makespan_from_spans",
    "rank_pairing_span_lower_bounds",
]

_NEG = float("-inf")


F = TypeVar("F", bound=Callable[..., Any])


def _paired_floor(fn: F) -> F:
    """``fn`` on ``CostModel.paired_floor`` of the costs it is given: where overlapped pairs
    may form, every bound reasons on the least time a pass can take in one."""
    @functools.wraps(fn)
    def bound(cost: CostModel, *args: Any, **kwargs: Any) -> Any:
        return fn(cost.paired_floor(), *args, **kwargs)

    return cast(F, bound)


def _tails(cost: CostModel, targets: set, preds) -> dict:
    """Longest end-to-end path from each pass to the end of some pass in ``targets``."""
    tail = {n: (0.0 if n in targets else _NEG) for n in preds}
    for n in reversed(pass_types(cost.num_stages)):
        if tail[n] == _NEG:
            continue
        for d, delay in preds[n]:
            tail[d] = max(tail[d], tail[n] + cost.time(n[0], n[1]) + delay)
    return tail


def _rank_paths(cost: CostModel, r: int, preds) -> tuple[dict, dict]:
    """Per pass type, its release from rank r's first pass (the forward of its lowest stage)
    and its tail to the end of r's last pass (``_NEG`` where there is no path)."""
    stages = cost.rank_stages(r)
    mine = {(s, op) for s in stages for op in (Op.F, Op.B, Op.W)}
    return earliest_starts(cost, (min(stages), Op.F), preds), _tails(cost, mine, preds)


def _carlier(jobs: list[tuple[float, float, float]], m: int) -> float:
    """max over thresholds of min release + m * total time + min tail, jobs = (rel, time, tail)."""
    best = 0.0
    for theta in {j[0] for j in jobs}:
        for tau in {j[2] for j in jobs}:
            work = sum(t for r, t, q in jobs if r >= theta and q >= tau)
            if work:
                best = max(best, theta + m * work + tau)
    return best


@_paired_floor
def rank_span_lower_bounds(cost: CostModel, num_microbatches: int) -> list[float]:
    """Per rank, the best Carlier bound over sets of pass types of one rank q (q = the rank
    itself or any other rank; see the module docstring)."""
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W
    preds = type_graph(cost)
    out = []
    for r in range(cost.num_ranks):
        rel, tail = _rank_paths(cost, r, preds)
        out.append(_best_carlier(cost, preds, rel, tail, num_microbatches))
    return out


def _best_carlier(cost: CostModel, preds, rel, tail, num_microbatches: int) -> float:
    """The best Carlier bound over the pass types of any one rank, given each type's release
    (``rel``) and tail (``tail``); 0 where no rank has a type with both."""
    best = 0.0
    for q in range(cost.num_ranks):
        jobs = [(rel[n], cost.time(*n), tail[n]) for n in preds
                if cost.stage_to_rank[n[0]] == q and rel[n] > _NEG and tail[n] > _NEG]
        if jobs:
            best = max(best, _carlier(jobs, num_microbatches))
    return best


def span_lower_bound(cost: CostModel, num_microbatches: int) -> float:
    """Lower bound on max over ranks of (last end - first start) on that rank."""
    return max(_with_pairing(cost, num_microbatches, rank_span_lower_bounds(cost, num_microbatches)))


def rank_pairing_span_lower_bounds(
    cost: CostModel, num_microbatches: int, limit: list[float] | None = None
) -> list[float]:
    """Per rank, its span's lower bound from what pairs cannot hide (0 where the passes hold no
    all-to-all, or recompute passes may run; see the module): the least busy time on
    ``paired_floor`` plus the least the warm-up window no pair can start in costs
    (``_warm_up_loss``), within ``limit`` where given (None: no limit)."""
    if not cost.has_all_to_all or cost.can_recompute:
        return [0.0] * cost.num_ranks
    floor, chain = cost.paired_floor().for_bounds(), cost.without_all_to_all().for_bounds()
    preds = type_graph(chain)
    m = num_microbatches
    out = []
    for r in range(cost.num_ranks):
        stages = cost.rank_stages(r)
        busy = m * sum(floor.t_f[s] + floor.t_b[s] + floor.t_w[s] for s in stages)
        rel = earliest_starts(chain, (min(stages), Op.F), preds)
        window = min(rel[(s, Op.B)] for s in stages)
        budget = None if limit is None else allowance(limit[r])
        out.append(busy + _warm_up_loss(cost, stages, window, m, budget))
    return out


def _warm_up_loss(cost: CostModel, stages: list[int], window: float, m: int, budget: float | None) -> float:
    """The least a rank loses over its least busy time on ``paired_floor`` in the ``window`` from
    its first start to its first backward, in which it can run forwards only, each alone.

    The window is k forwards and idle time I. Each forward of stage s keeps its all-to-all
    (``CostModel.hideable``) and leaves a backward without a partner (a pair takes one of each,
    and a rank has as many of each), which keeps the least of the rank's: it loses h_s, and it
    covers at most d_s of the window (its longest time alone; longer, as when slowed, the rest
    counts as idle). The loss is the least of sum k_s h_s + max(0, window - sum k_s d_s) over
    counts 1 <= k_s <= m, whole numbers (the first backward's microbatch has a forward of each
    of the rank's stages in the window; the window times the least h_s / d_s, or 1, is the
    fractional relaxation), and within ``budget`` (None: no limit): nothing frees memory before
    the first backward, so the forwards' m_f fit in it together. Ranks of more than two stages
    take the fractional relaxation, without the budget or the forwards each stage must run."""
    # what a pass alone keeps over its floor: what a pair hides of it, no more than its time
    least_b = min(min(cost.hideable(s, Op.B), cost.t_b[s], cost.t_bw[s]) for s in stages)
    items = [(max(cost.t_f[s], cost.t_ff[s]), min(cost.hideable(s, Op.F), cost.t_f[s], cost.t_ff[s]) + least_b,
              cost.m_f[s]) for s in stages]
    if len(stages) > 2:
        return window * min(1.0, min((h / d for d, h, _ in items if d > 0), default=1.0))
    if any(mu < 0 for _, _, mu in items):  # a forward that frees memory: the others may hold more
        budget = None
    # the first backward's microbatch has a forward of each stage of the rank in the window
    *first, (d, h, mu) = items
    best = math.inf
    for ks in itertools.product(*(range(1, max(1, min(m, math.ceil(window / d0))) + 1) if d0 > 0 else range(1, 2)
                                  for d0, _, _ in first)):
        held = sum(k * x for k, (_, _, x) in zip(ks, first))
        rest = window - sum(k * x for k, (x, _, _) in zip(ks, first))
        lost = sum(k * x for k, (_, x, _) in zip(ks, first))
        if budget is not None and held > budget:
            continue
        most = m if budget is None or mu <= 0 else min(m, math.floor((budget - held) / mu))
        # the loss is convex and piecewise linear in the last stage's count: its least is at an end or where it covers the rest
        near = (math.floor(rest / d), math.ceil(rest / d)) if d > 0 and rest > 0 else ()
        for k in {1, most, *near}:
            if 1 <= k <= most:
                best = min(best, lost + k * h + max(0.0, rest - k * d))
    return best if best < math.inf else window  # (no forwards fit: no schedule runs within the limit)


def _with_pairing(
    cost: CostModel, num_microbatches: int, spans: list[float], limit: list[float] | None = None
) -> list[float]:
    """Per-rank span bounds ``spans`` raised to ``rank_pairing_span_lower_bounds`` (within
    ``limit``, None: no limit) where higher."""
    if not cost.has_all_to_all:
        return spans
    return [max(a, b) for a, b in zip(spans, rank_pairing_span_lower_bounds(cost, num_microbatches, limit))]


@_paired_floor
def makespan_lower_bound(cost: CostModel, num_microbatches: int) -> float:
    """Lower bound on (last end anywhere - first start anywhere)."""
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W
    preds = type_graph(cost)
    rel = earliest_starts(cost, (0, Op.F), preds)
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
        fit = m - a if room <= 0 else (limit - base) / room  # finite or not (tiny room)
        b = m - a if fit >= m - a else int(fit)
        best = min(best, max(0.0, gap - (a - 1) * (cost.t_b[s] + cost.t_w[s]) - b * cost.t_w[s]))
    return 0.0 if best == float("inf") else best


def _memory_path(cost: CostModel, s: int, lag: float, m: int, limit: float) -> float:
    """Longest path through one single-stage rank's passes when memory orders them (see
    rank_memory_span_lower_bounds); 0 when a pass allocates in B or W (no closed form)."""
    mem_f, mem_b, mem_w = cost.m_f[s], cost.m_b[s], cost.m_w[s]
    if mem_b > 0 or mem_w > 0:
        return 0.0
    tf, tb, tw = cost.t_f[s], cost.t_b[s], cost.t_w[s]
    sf = sb = sw = float("-inf")
    end_b: list[float] = []
    end_w: list[float] = []
    for j in range(m):
        # F(j) needs n_b earlier B passes done (every W done too at best) and n_w earlier W
        # passes done (every B done at best) for memory to stay within the limit.
        need = (j + 1) * mem_f - limit
        n_b = 0 if need <= 0 else (math.ceil(need / -(mem_b + mem_w) - REL_TOL) if mem_b + mem_w < 0 else j + 1)
        n_w = 0 if need + j * mem_b <= 0 else (math.ceil((need + j * mem_b) / -mem_w - REL_TOL) if mem_w < 0 else j + 1)
        if n_b > j or n_w > j:
            return float("inf")  # memory cannot hold even this: no schedule exists
        sf = max(0.0 if j == 0 else sf + tf, end_b[n_b - 1] if n_b else 0.0, end_w[n_w - 1] if n_w else 0.0)
        sb = max(sf + lag, sb + tb)
        sw = max(sb + tb, sw + tw)
        end_b.append(sb + tb)
        end_w.append(sw + tw)
    return max(end_b[-1], end_w[-1])


@_paired_floor
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
    of generality in the idle relaxation (``zbsearch.solver.problem``), so memory after F(j) is (j+1)*m_f +
    n_B*m_b + n_W*m_w with n_B, n_W the B and W passes before it. With m_b, m_w <= 0 this
    forces B(n_B - 1) and W(n_W - 1) before F(j) for the least n_B, n_W that can satisfy the
    limit. Those precedences, the lag from each F to its B and the order within each kind
    form a graph whose longest path bounds the span; at the smallest limit it is exactly the
    sequential schedule's span.
    Communication delays enter through the dependency path, as in the bounds above.
    """
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W
    m = num_microbatches
    preds = type_graph(cost)
    out = []
    for r in range(cost.num_ranks):
        stages = cost.rank_stages(r)
        lim = allowance(limit[r])  # what the validator accepts
        rel = earliest_starts(cost, (min(stages), Op.F), preds)
        lag = min(rel[(s, Op.B)] for s in stages)
        start = max(0.0, lag - _max_forward_work(cost, stages, lim, m))
        end = _end_idle(cost, stages[0], lag, m, lim) if len(stages) == 1 else 0.0
        all_forwards = m * sum(max(cost.m_f[s], 0.0) for s in stages)
        idle = start + end if all_forwards > lim else max(start, end)
        path = _memory_path(cost, stages[0], lag, m, lim) if len(stages) == 1 else 0.0
        out.append(max(cost.rank_busy(r, m) + idle, path))
    return out


def _deferred_work(cost: CostModel, q: int, allowed: float, m: int, split: CostModel, stages: list[int] | None = None) -> float:
    """Most W time (``for_bounds`` costs) rank q can leave for after its last B starts: that
    B's own W, and the W of other microbatches pending then, beside the last B's microbatch,
    whole (m_f), within ``allowed``. A W pending is a split backward's: its microbatch holds
    what the B of ``split`` (the costs before ``for_bounds`` moved W's memory into B, as a fused
    BW frees it) leaves, m_f + m_b. Whole microbatches for one stage, else a fractional
    knapsack over its stages, an upper bound on any integer choice. ``stages``: of those stages
    only (the last B among theirs; the other stages' microbatches hold nothing below zero)."""
    stages = stages or cost.rank_stages(q)
    held_any = m * len(cost.rank_stages(q)) * ABS_TOL  # done ones may hold -ABS_TOL
    room = allowed - min(cost.m_f[s] for s in stages) + held_any
    work = max(cost.t_w[s] for s in stages)  # the last B's own W
    left = {s: m - (len(stages) == 1) for s in stages}  # one stage: the last B's microbatch is not among them
    for s in sorted(stages, key=lambda s: -cost.t_w[s] / max(split.m_f[s] + split.m_b[s], 1e-300)):
        held = split.m_f[s] + split.m_b[s]
        n = left[s] if held <= 0 else min(left[s], max(room, 0.0) / held)
        if len(stages) == 1:
            n = min(left[s], math.floor(n * (1 + REL_TOL)))
        work += n * cost.t_w[s]
        room -= n * max(held, 0.0)
    return work


@_paired_floor
def rank_deferral_span_lower_bounds(cost: CostModel, num_microbatches: int, limit: list[float]) -> list[float]:
    """Per rank, a lower bound on its span for schedules within ``limit``, recomputing or not.

    Rank q runs every F and every B of its stages before its last B ends, and every W but those
    still pending when it starts and its own. Just before that B nothing else is in flight on
    q: its microbatch holds m_f, each pending W's m_f + m_b (a split backward's B leaves that:
    a fused one leaves no W) and none less than nothing, within the limit: a knapsack bounds
    their time. For rank r, q's first pass starts no earlier than the
    dependency path from r's first pass allows (q at or after r along the pipeline) and the
    end of q's last B still needs the path from it to r's end: r's span is at least that
    release + the work above + that tail (the one-machine bound of ``rank_span_lower_bounds``
    with the W passes memory forces before the last B)."""
    split = cost  # what a split backward's microbatch holds between its B and its W
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W
    m = num_microbatches
    preds = type_graph(cost)
    out = []
    for r in range(cost.num_ranks):
        rel, tail = _rank_paths(cost, r, preds)
        best = 0.0
        for q in range(cost.num_ranks):
            allowed = allowance(limit[q])
            if not math.isfinite(allowed) or not _balanced_rank(cost, q) or not _balanced_rank(split, q):
                continue
            theirs = cost.rank_stages(q)
            start = min(rel[(s, op)] for s in theirs for op in (Op.F, Op.B, Op.W))
            end = min(tail[(s, Op.B)] for s in theirs)
            if start == _NEG or end == _NEG:
                continue
            work = m * sum(cost.t_f[s] + cost.t_b[s] + cost.t_w[s] for s in theirs) - _deferred_work(cost, q, allowed, m, split)
            best = max(best, start + work + end)
        out.append(best)
    return out


# ---------------------------------------------------------------------------------------------
# Per-microbatch bounds: every pass of every microbatch is a job with its own release and tail.


def _memory_counts(cost: CostModel, r: int, s: int, j: int, allowed: float) -> tuple[int, int] | None:
    """(n_b, n_w): B and W passes of stage s that must precede F(s, j) on rank r for memory
    to stay within ``allowed`` (see rank_chain_span_lower_bounds); None when no F(s, j) fits."""
    lower = [t for t in cost.rank_stages(r) if t <= s]
    M = sum(cost.m_f[t] for t in lower)  # held by a microbatch whose B(s) has not run
    b = cost.m_f[s] + cost.m_b[s]  # ... whose B(s) has run but not W(s)
    c = b + cost.m_w[s]  # ... whose W(s) has run
    n_b = 0 if (j + 1) * M <= allowed else (math.ceil(((j + 1) * M - allowed) / (M - c) - REL_TOL) if M > c else j + 1)
    need = M + j * b - allowed
    n_w = 0 if need <= 0 else (math.ceil(need / (b - c) - REL_TOL) if b > c else j + 1)
    return None if n_b > j or n_w > j else (n_b, n_w)


def _balanced_rank(cost: CostModel, r: int) -> bool:
    """F allocates, B and W only free, and never more than F allocated (per stage)."""
    return all(
        cost.m_f[s] >= 0 and cost.m_b[s] <= 0 and cost.m_w[s] <= 0 and cost.m_f[s] + cost.m_b[s] + cost.m_w[s] >= -ABS_TOL
        for s in cost.rank_stages(r)
    )


def _jackson(jobs: list[tuple[float, float, float]]) -> float:
    """Jackson's preemptive schedule of jobs (release, time, tail) on one machine: its value
    max(end + tail) is the least any schedule of the jobs can have, preemptive or not, and equals
    max over subsets J of min release + total time + min tail (Carlier 1982)."""
    jobs = sorted(jobs)
    heap: list[tuple[float, float]] = []
    n, i, t, best = len(jobs), 0, _NEG, _NEG
    while i < n or heap:
        if not heap:
            t = max(t, jobs[i][0])
        while i < n and jobs[i][0] <= t:
            heapq.heappush(heap, (-jobs[i][2], jobs[i][1]))
            i += 1
        neg_tail, left = heapq.heappop(heap)
        nxt = jobs[i][0] if i < n else math.inf
        if t + left > nxt:  # run until the next release, which may preempt
            heapq.heappush(heap, (neg_tail, left - (nxt - t)))
            t = nxt
        else:
            t += left
            best = max(best, t - neg_tail)
    return best


@_paired_floor
def rank_chain_span_lower_bounds(
    cost: CostModel, num_microbatches: int, limit: list[float] | None = None, deadline: float | None = None
) -> list[float] | None:
    """Per rank, a lower bound on its span from one-machine bounds over single passes; None if
    still running at ``deadline`` (a ``deadline.now()`` instant): it takes seconds at p=32,
    m=256 and grows as p^2 m.

    Passes of one kind run in microbatch order on each stage without loss of generality in the
    idle relaxation, which every ASAP schedule is a point of (``zbsearch.solver.problem``:
    relabelling keeps every time slot and memory count), so take
    such a schedule. Rank r's first pass is then F(s0, 0), s0 its lowest stage (every pass of
    microbatch j on the rank depends on F(s0, j)), say at t0. These precedences hold:
    dependencies (with their communication delay), X(s, j-1) before X(s, j) for each kind X
    (one machine, microbatch order), and, under a memory limit, B and W passes that must come
    before an F to make room for it (below). So every pass x starts at t0 + rel(x) or later,
    rel(x) = the longest path from F(s0, 0) to x in that graph, and once x ends the rank still
    runs at least tail(x) = the longest path from the end of x to the end of a pass of rank r.
    Each rank q (r itself or any other) runs its passes one at a time; the passes with finite
    rel and tail form a one-machine problem with release dates and delivery times whose
    optimum, even preemptive, is a lower bound on rank r's span: Jackson's preemptive
    schedule computes it exactly (O(n log n)). The bound is the largest over q.

    Memory precedences (ranks whose stages have F allocating and B, W freeing, never below
    zero per microbatch): just after F(s, j) on rank r, a microbatch i <= j whose B(s, i) has
    not run holds the activations of every stage t <= s of the rank (its F(t, i) ran, its
    B(t, i) needs B(s, i)): M = sum of m_f there; one whose B(s, i) ran but not W(s, i) holds
    b = m_f + m_b of stage s at least, one whose W(s, i) ran c = b + m_w at least, and nothing
    else is negative. With n_B, n_W the numbers of B(s, .) and W(s, .) passes run before (a
    prefix each; n_W <= n_B <= j) memory is at least (j+1-n_B) M + (n_B-n_W) b + n_W c <= limit.
    Taking n_W = n_B gives the least n_B, taking n_B = j the least n_W; B(s, n_B - 1) and
    W(s, n_W - 1) then end before F(s, j) starts. For one stage per rank these are the
    precedences of rank_memory_span_lower_bounds; for two (V) they count both stages.
    """
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W
    m = num_microbatches
    S, R = cost.num_stages, cost.num_ranks
    types = pass_types(S)
    K = len(types)
    kid = {t: k for k, t in enumerate(types)}
    dur = [cost.time(*t) for t in types]
    rank_of = [cost.stage_to_rank[s] for s, _ in types]
    # preds[x] = (y, weight): x starts at least weight after y starts; node x = j * K + k
    preds: list[list[tuple[int, float]]] = [[] for _ in range(K * m)]
    graph = type_graph(cost)
    for j in range(m):
        base = j * K
        for k, t in enumerate(types):
            row = preds[base + k]
            for dep, delay in graph[t]:
                k2 = kid[dep]
                row.append((base + k2, dur[k2] + delay))
            if j:
                row.append((base - K + k, dur[k]))
    if limit is not None:
        for r in range(R):
            allowed = allowance(limit[r])  # what the validator accepts
            if not math.isfinite(allowed) or not _balanced_rank(cost, r):
                continue
            for s in cost.rank_stages(r):
                kf, kb, kw = kid[(s, Op.F)], kid[(s, Op.B)], kid[(s, Op.W)]
                for j in range(m):
                    counts = _memory_counts(cost, r, s, j, allowed)
                    if counts is None:
                        continue  # infeasible limit: reported elsewhere, no precedence here
                    n_b, n_w = counts
                    if n_b:
                        preds[j * K + kf].append(((n_b - 1) * K + kb, dur[kb]))
                    if n_w:
                        preds[j * K + kf].append(((n_w - 1) * K + kw, dur[kw]))
    succs: list[list[tuple[int, float]]] = [[] for _ in range(K * m)]
    for x, row in enumerate(preds):
        for y, w in row:
            succs[y].append((x, w - dur[y % K] + dur[x % K]))  # end of y to end of x
    N = K * m
    # heads[x][r]: rel of node x for rank r's bound; tails[x][r] likewise (all ranks at once)
    heads: list[list[float]] = [[_NEG] * R for _ in range(N)]
    for r in range(R):
        heads[kid[(min(cost.rank_stages(r)), Op.F)]][r] = 0.0
    for x in range(N):
        h = heads[x]
        for y, w in preds[x]:
            h = [a if a >= b + w else b + w for a, b in zip(h, heads[y])]
        heads[x] = h
        if _late(x, deadline):
            return None
    tails: list[list[float]] = [[]] * N
    for x in range(N - 1, -1, -1):
        if _late(x, deadline):
            return None
        q = [_NEG] * R
        q[rank_of[x % K]] = 0.0
        for y, w in succs[x]:  # w: from the end of x to the end of y
            q = [a if a >= b + w else b + w for a, b in zip(q, tails[y])]
        tails[x] = q
    on_rank = [[(x, dur[x % K]) for x in range(N) if rank_of[x % K] == q] for q in range(R)]
    out = []
    for head, tail in zip(zip(*heads), zip(*tails)):
        best = 0.0
        for nodes in on_rank:
            jobs = [(head[x], d, tail[x]) for x, d in nodes if head[x] > _NEG and tail[x] > _NEG]
            if jobs:
                best = max(best, _jackson(jobs))
        out.append(best)
    return out


# ---------------------------------------------------------------------------------------------
# The area bound: memory held over time, against the limit times the span.


# The program's answer is trusted to this share less (HiGHS solves to tolerances, not exactly).
_LP_MARGIN = 1e-6


@_paired_floor
def _area_applies(bc: CostModel, r: int, allowed: float) -> bool:
    """Whether the area program can say more than rank ``r``'s busy time: its memory never
    drops below zero per microbatch (``_balanced_rank`` on ``bc``, ``cost.for_bounds()``) and
    the allowance is finite and positive."""
    return _balanced_rank(bc, r) and 0 < allowed < math.inf


def rank_area_span_lower_bounds(cost: CostModel, num_microbatches: int, limit: list[float], whole: bool = True,
                                deadline: float | None = None) -> list[float]:
    """Per rank, a lower bound on its span for schedules within ``limit``, over every choice of
    which microbatches to recompute (plain only where the costs offer no recomputation).

    Each microbatch j of each stage s of the rank runs plain or checkpointed for a recompute
    pass o: this costs the rank x_o more time than its cheapest forward would (the recompute
    pass and the checkpointed forward's extra), 0 for plain. These facts hold in every schedule:

    * Busy time: the span is at least busy + the extras chosen (busy: ``CostModel.rank_busy``).
    * Area: memory is a step function of time that never exceeds the limit M, so over the span
      T its integral is at most M * T. From the start of F(s, j) to that of B(s, j), at least
      L_s apart (the dependency path through later stages), microbatch j holds m_f, or,
      checkpointed, ``keep`` until its recompute pass and m_f from there, at least t_r before B
      (t_r: the recompute pass's least time, before a fused or a split backward):
      at least keep * L_s + (m_f - keep) * t_r (after B it may hold nothing: a fused BW frees
      it all at once).
    * Start: before the rank's first B (at least ``lag`` after its first pass starts) it runs
      forwards and recompute passes only, and nothing frees memory: what the forwards started
      there keep, and the recompute passes started there rebuild, fits M, and the first B's
      own microbatch is whole when it starts (plain, or rebuilt in the window). A pass started
      there covers at most its own time of that window: the rank idles at least lag less that.
      A forward's time and its recompute pass's counted there cancel against the same time in
      the busy sum, so the span is at least busy + the extras of the other microbatches + lag,
      less the cheapest forward time per microbatch started in the window, plus t_r for each
      one checkpointed there whose recompute pass runs later.

    The least span these allow over every choice of counts bounds the span: whole
    microbatches (an integer program, small, per rank; HiGHS), or with ``whole`` False, or
    for the ranks left once ``deadline`` has passed, fractional ones too (its LP relaxation,
    lower and faster).

    In flight: a microbatch is in flight on a stage from the start of its F to that of its B.
    When a B starts, its microbatch holds m_f there and every other microbatch in flight on the
    rank at least what the least keeping way keeps, k > 0; so at most c = 1 + (M - m_f) / k are
    in flight then. Only a B start lowers the count, so it never exceeds c (a schedule that
    let it could start no B again), and the time in flight, at least L_s per microbatch and
    stage, sums to at most c * T. At the least limit with one stage per rank (c = 1) this is
    the sequential schedule's m * L_s, with recomputation or without.

    Whole at once: a microbatch of stage s holds at least h_s = m_f + min(0, m_b) from the
    start of the pass that makes it whole (its F plain, its recompute pass checkpointed) to the
    end of its backward's last pass (W split, BW fused): at least L_s + the least backward
    plain, t_r + the least backward checkpointed. Memory is checked after every pass, so at
    any instant at most c = floor(M / min h_s) microbatches are in that state (each was so after
    the pass then running or the one before it; the others hold nothing less than zero): those
    times sum to at most c * T. At the least limit with one stage per rank and m_b = 0 (c = 1)
    each plain microbatch takes L_s + its backward of the span alone, whatever the order.

    Whole sets: per stage, a microbatch holds all of m_f from the start of the pass that makes
    it whole to the end of its B (in ``for_bounds``' split model, where a fused BW is a B then
    a W): at least L_s + B plain, t_r + B checkpointed. At any instant the counts per stage of
    those so held fit the limit together (as above), so they lie in the set P of count vectors
    c with sum c_s m_f_s within M (``_whole_sets``: its maximal ones). Take lambda_p the time
    spent with the counts under p (a maximal vector for each instant): sum lambda_p <= T, and
    stage s's times sum to at most sum lambda_p p_s. The passes that run with their microbatch
    so held (a plain forward, a recompute pass, a B) run one at a time, with p_s >= 1 for their
    stage: for every set Q of the rank's stages, those of Q take at most the lambda of the p
    with some p_s >= 1 in Q (Hall's condition for spreading them over the lambda). On a V rank
    whose two stages cannot be whole together, this keeps the two stages' backward work apart.

    Apart: a microbatch of a later stage x of the rank is whole when its B starts, and that B
    runs inside the same microbatch's F to B on stage s. There the microbatch holds m_f plain,
    or until its recompute pass what its way keeps (never more than m_f), beside x's m_f: a way
    that cannot fit is left out, and where m_f of both cannot (``_apart``) the microbatch is
    checkpointed and its recompute pass starts after x's B ends: it holds what it keeps from its
    forward to the dependency path to that B's end, not to its own B, and cannot be rebuilt
    before the rank's first B.

    Only for ranks whose memory never drops below zero per microbatch (F allocates, B and W
    free, within what F allocated); elsewhere the busy time."""
    bc = cost.for_bounds()
    preds = type_graph(bc)
    out = []
    for r in range(cost.num_ranks):
        whole = whole and not (deadline is not None and clock.now() > deadline)
        out.append(_area_bound(cost, bc, preds, r, num_microbatches, allowance(limit[r]), whole, core=False))
    return out


def _apart(cost: CostModel, r: int, s: int, room: float) -> list[int]:
    """The stages of rank ``r`` after ``s`` whose microbatches no microbatch of ``s`` can be
    whole beside within ``room`` (``rank_area_span_lower_bounds``): m_f of both above it."""
    return [x for x in cost.rank_stages(r) if x > s and cost.m_f[s] + cost.m_f[x] > room]


def _area_bound(cost: CostModel, bc: CostModel, preds, r: int, m: int, allowed: float, whole: bool, core: bool,
                stages: list[int] | None = None) -> float:
    """The bound of ``rank_area_span_lower_bounds`` on rank ``r`` (``bc``: ``cost.for_bounds()``,
    ``preds`` its type graph). ``core``: on the rank's *core* instead of its span, from the start
    of its first pass to the end of its last B (or BW), whose busy time leaves out the W passes
    and where a microbatch counts as whole to the end of its B only (``rank_relay_span_lower_bounds``):
    every fact of the program holds there as well, since every forward, recompute pass and B of
    the rank runs in it, and a microbatch holds what the area and in-flight rows count from the
    start of its forward to the start of its B. ``stages``: with ``core``, the core of those of
    the rank's stages only, from the first forward of one of them to the last B among them (the
    other stages' microbatches hold nothing below zero: they only take memory)."""
    from ._highs import quiet_highs

    stages = stages or cost.rank_stages(r)
    backward = (lambda s: bc.t_b[s]) if core else bc.backward
    busy = m * sum(cost.forward(s) + cost.backward(s) for s in stages) if core else cost.rank_busy(r, m)
    if not _area_applies(bc, r, allowed):
        return busy
    if core:  # the W passes that memory lets the rank leave for after its last B run outside the core
        busy -= (_deferred_work(bc, r, allowed, m, cost, stages) if _balanced_rank(cost, r)
                 else m * sum(bc.t_w[s] for s in stages))
    first = earliest_starts(bc, (min(stages), Op.F), preds)
    lag = min(first[(s, Op.B)] for s in stages)
    # columns: per stage and way of holding a microbatch, its count outside the window (n), in
    # the window (w) and, checkpointed, in the window with its recompute pass there too (v)
    cols: list[_Column] = []
    room = allowed + m * len(cost.rank_stages(r)) * ABS_TOL  # finished microbatches may hold -ABS_TOL each
    for s in stages:
        path = earliest_starts(bc, (s, Op.F), preds)
        lag_s = path[(s, Op.B)]
        # a later stage of the rank is whole inside each microbatch of s (at its B), beside
        # what that microbatch holds there: its m_f plain, what its way keeps checkpointed
        beside = max((cost.m_f[x] for x in cost.rank_stages(r) if x > s), default=0.0)
        apart = _apart(cost, r, s, room)  # where m_f cannot be beside: the recompute pass after the B
        after = max((path[(x, Op.B)] + bc.t_b[x] for x in apart), default=_NEG)
        least_f, least_b = cost.forward(s), backward(s)
        plain = min(cost.t_f[s], cost.t_ff[s]) - least_f
        area, held, full, need = cost.m_f[s] * lag_s, lag_s + least_b, lag_s + bc.t_b[s], least_f + plain + bc.t_b[s]
        if not apart:
            cols += [_Column(s, plain, area, math.inf, 0.0, False, held, full, need),
                     _Column(s, plain, area, cost.m_f[s], -least_f, True, held, full, need)]
        for op in cost.recompute_ops(s):
            o = cost.offer(s, op)
            assert o is not None
            if min(o.keep, cost.m_f[s]) + beside > room:
                continue  # this way cannot hold the microbatch beside the later stage's
            t_r = o.least  # before a fused or a split backward
            lag_o = max(lag_s, after + t_r)
            extra = t_r + o.t_f - least_f
            area, held, full = o.keep * lag_o + (cost.m_f[s] - o.keep) * t_r, t_r + least_b, t_r + bc.t_b[s]
            cols += [_Column(s, extra, area, math.inf, 0.0, False, held, full, full),
                     _Column(s, extra, area, o.keep, t_r - least_f, False, held, full, full)]
            if not apart:  # (else its recompute pass runs after the rank's first B)
                cols.append(_Column(s, extra, area, cost.m_f[s], -least_f, True, held, full, full))
    bound = _area_lp(quiet_highs(), cols, stages, m, busy, lag, allowed, whole, _whole_at_once(cost, r, m, allowed, core, stages),
                     _whole_sets(cost, r, m, allowed, stages))
    least_keep = min(min([cost.m_f[s], *(cost.offer(s, op).keep for op in cost.recompute_ops(s))])  # type: ignore[union-attr]
                     for s in stages)
    if least_keep > 0:
        c = 1 + math.floor((allowed - min(cost.m_f[s] for s in stages)) / least_keep * (1 + REL_TOL))
        in_flight = sum(m * earliest_starts(bc, (s, Op.F), preds)[(s, Op.B)] for s in stages)
        bound = max(bound, in_flight / max(1, c))
    return max(busy, bound)


@_paired_floor
def rank_relay_span_lower_bounds(cost: CostModel, num_microbatches: int, limit: list[float], whole: bool = True,
                                 deadline: float | None = None) -> list[float]:
    """Per rank, a lower bound on its span for schedules within ``limit`` from what memory makes
    another rank (or a stage of its own) take, over every choice of which microbatches to
    recompute.

    Take a rank q and a set Q of its stages (all of them, or one of a V's two). Their *core*
    runs from the start of the first forward on Q to the end of the last B (or BW) on Q. Every
    forward, recompute pass and B on Q runs in it, and so does every W on Q but those pending
    when that last B starts and its own, which memory caps (``_deferred_work``); a microbatch
    holds what the area bound counts from the start of its forward to the start of its B, in the
    core too, and is whole (all of m_f) from the pass that makes it whole to the end of its B
    (``_whole_at_once`` with ``core``); the microbatches of q's other stages hold nothing below
    zero. So the program of ``rank_area_span_lower_bounds`` with that busy time and those
    whole times bounds the core's length D (``_area_bound`` with ``core``). For rank r, the core
    starts no earlier than the dependency path from r's first pass to a forward on Q allows, and
    after it the chain from the last B to r's last pass still runs: r's span is at least that
    release + D + that tail, wherever r's first pass reaches every forward on Q and every B on Q
    reaches a pass of r (q = r, or q later along the pipeline). Where q's memory, not its work,
    sets D (one microbatch whole at a time, say), this is what q's memory makes r wait for,
    which no bound of one rank sees. Only for ranks q whose memory never drops below zero per
    microbatch, as the area bound."""
    bc = cost.for_bounds()
    preds = type_graph(bc)
    m = num_microbatches
    cores: list[tuple[list[int], float]] = []  # (stages, least core) of each rank and set of its stages
    for q in range(cost.num_ranks):
        allowed = allowance(limit[q])
        if not _area_applies(bc, q, allowed):
            continue  # its busy time: the one-machine bounds count that already
        mine = cost.rank_stages(q)
        for k in range(len(mine), 0, -1):
            for subset in itertools.combinations(mine, k):
                whole = whole and not (deadline is not None and clock.now() > deadline)
                cores.append((list(subset), _area_bound(cost, bc, preds, q, m, allowed, whole, True, list(subset))))
    out = []
    for r in range(cost.num_ranks):
        rel, tail = _rank_paths(bc, r, preds)
        best = 0.0
        for theirs, d in cores:
            start = min(rel[(s, Op.F)] for s in theirs)
            end = min(tail[(s, Op.B)] for s in theirs)
            if start > _NEG and end > _NEG:
                best = max(best, start + d + end)
        out.append(best)
    return out


@dataclass(frozen=True)
class _Column:
    """A count of ``rank_area_span_lower_bounds``'s program: microbatches of ``stage`` held one
    way (plain, or checkpointed for one recompute pass) with their extra time and area;
    ``memory`` what each holds at the window's end (inf: not in the window), ``window`` its
    term there (extra less its time in the window), ``whole`` whether it is whole then."""

    stage: int
    extra: float
    area: float
    memory: float
    window: float
    whole: bool
    held: float  # the least time it is whole at once (see ``_whole_at_once``)
    full: float = 0.0  # the least time it holds all of m_f, to the end of its B (see ``_whole_sets``)
    need: float = 0.0  # the least time of its passes that run while it holds all of m_f (ditto)


def _whole_at_once(cost: CostModel, r: int, m: int, allowed: float, core: bool = False,
                   stages: list[int] | None = None) -> int | None:
    """The most microbatches rank ``r`` can hold whole at once (``rank_area_span_lower_bounds``),
    on the true (split) memory deltas; None where that is every one of them or memory may drop
    below zero per microbatch. ``core``: whole to the end of the B only, where a microbatch
    holds all of m_f (after the pass that makes it whole and before its B or BW in the rank's
    order: at an instant some such microbatches share, the state after the pass then running,
    or the one before it where that is one of their B, has each of them whole). ``stages``: of
    those stages only."""
    if not _balanced_rank(cost, r):
        return None
    stages = stages or cost.rank_stages(r)
    least = min(cost.m_f[s] + (0.0 if core else min(0.0, cost.m_b[s])) for s in stages)
    room = allowed + m * len(cost.rank_stages(r)) * ABS_TOL  # finished microbatches may hold -ABS_TOL each
    if least <= 0 or room / least >= m * len(stages):
        return None
    return math.floor(room / least * (1 + REL_TOL))


def _whole_sets(cost: CostModel, r: int, m: int, allowed: float, stages: list[int]) -> list[tuple[int, ...]] | None:
    """The count vectors, one count per stage of ``stages``, of the microbatches rank ``r`` can
    hold with all of m_f at once within ``allowed`` (``rank_area_span_lower_bounds``), those no
    other one exceeds in every count; None where the stages may hold all m each at once together,
    memory may drop below zero per microbatch, or there are more than ``_MOST_SETS``."""
    if not _balanced_rank(cost, r):
        return None
    room = allowed + m * len(cost.rank_stages(r)) * ABS_TOL  # finished microbatches may hold -ABS_TOL each
    size = [max(cost.m_f[s], 0.0) for s in stages]

    def most(k: int, left: float) -> int:
        return m if size[k] <= 0 else max(0, min(m, math.floor(left / size[k] * (1 + REL_TOL))))

    if sum(m * x for x in size) <= room:
        return None
    found: list[tuple[int, ...]] = []
    # every count but the last, then the last as large as fits: each vector that fits lies under one
    for head in itertools.product(*(range(most(k, room) + 1) for k in range(len(stages) - 1))):
        left = room - sum(c * x for c, x in zip(head, size))
        if left >= -room * REL_TOL:
            found.append((*head, most(len(stages) - 1, left)))
        if len(found) > 4 * _MOST_SETS:
            return None
    out = [p for p in found if not any(q != p and all(b >= a for a, b in zip(p, q)) for q in found)]
    return out if len(out) <= _MOST_SETS else None


_MOST_SETS = 16  # beyond that many count vectors the rows are left out: they bind where few microbatches fit


def _area_lp(h, cols: list[_Column], stages: list[int], m: int, busy: float, lag: float, allowed: float,
             whole: bool, at_once: int | None = None, sets: list[tuple[int, ...]] | None = None) -> float:
    """The least T of ``rank_area_span_lower_bounds``'s integer program (``whole``) or of its
    LP relaxation; ``at_once``: how many microbatches may be whole at once (None: no limit);
    ``sets``: the count vectors of microbatches per stage that may hold all of m_f at once
    (None: no limit)."""
    import highspy

    inf = math.inf
    n = len(cols)
    t = n  # T, the last column
    h.addVars(n + 1, [0.0] * (n + 1), [inf] * (n + 1))
    h.changeColsCost(1, [t], [1.0])  # minimise T
    counts = list(range(n))
    for s in stages:  # every microbatch is held one way: m per stage
        idx = [k for k in counts if cols[k].stage == s]
        h.addRow(m, m, len(idx), idx, [1.0] * len(idx))
    window = [k for k in counts if cols[k].memory < inf]
    h.addRow(-inf, allowed, len(window), window, [cols[k].memory for k in window])  # the window fits memory
    # the first B's microbatch is whole when that B starts
    rebuilt = [k for k in window if cols[k].whole]
    h.addRow(1.0, inf, len(rebuilt), rebuilt, [1.0] * len(rebuilt))
    # T - sum extra >= busy
    h.addRow(busy, inf, n + 1, counts + [t], [-cols[k].extra for k in counts] + [1.0])
    # T - sum (extra outside the window, window term inside) >= busy + lag
    start = [-(cols[k].extra if cols[k].memory == inf else cols[k].window) for k in counts]
    h.addRow(busy + lag, inf, n + 1, counts + [t], start + [1.0])
    # M T - sum area >= 0
    h.addRow(0.0, inf, n + 1, counts + [t], [-cols[k].area for k in counts] + [allowed])
    if at_once is not None:  # c T - sum held >= 0
        h.addRow(0.0, inf, n + 1, counts + [t], [-cols[k].held for k in counts] + [float(at_once)])
    if sets is not None:  # the time each stage's microbatches hold all of m_f lies in T conv(sets)
        first = h.getNumCol()
        h.addVars(len(sets), [0.0] * len(sets), [inf] * len(sets))
        lam = list(range(first, first + len(sets)))
        h.addRow(-inf, 0.0, len(sets) + 1, lam + [t], [1.0] * len(sets) + [-1.0])  # sum lambda <= T
        for i, s in enumerate(stages):  # sum full <= sum lambda_p p_s
            idx = [k for k in counts if cols[k].stage == s]
            h.addRow(-inf, 0.0, len(idx) + len(sets), idx + lam, [cols[k].full for k in idx] + [-float(p[i]) for p in sets])
        for size in range(1, len(stages) + 1):  # the passes that need a stage of Q whole run in the sets that hold one
            for q in itertools.combinations(range(len(stages)), size):
                idx = [k for k in counts if stages.index(cols[k].stage) in q]
                hold = [j for j, p in zip(lam, sets) if any(p[i] for i in q)]
                h.addRow(-inf, 0.0, len(idx) + len(hold), idx + hold, [cols[k].need for k in idx] + [-1.0] * len(hold))
    if whole:  # microbatches come whole: the counts are integers
        h.changeColsIntegrality(n, counts, [highspy.HighsVarType.kInteger] * n)
    h.run()
    info = h.getInfo()
    clock.highs_spent(max(0, info.mip_node_count), max(0, info.simplex_iteration_count), h.getNumNz())
    if h.getModelStatus() != h.getModelStatus().kOptimal:
        return busy  # cannot happen (every all-plain choice is feasible for a large enough T); be safe
    # an integer program's proven dual bound, whatever gap its search stopped at
    return (info.mip_dual_bound if whole else info.objective_function_value) * (1 - _LP_MARGIN)


def _late(step: int, deadline: float | None) -> bool:
    """Whether ``deadline`` has passed, looked at every 256 steps of a long loop."""
    return deadline is not None and not step & 255 and clock.now() > deadline


def memory_span_lower_bound(
    cost: CostModel, num_microbatches: int, limit: list[float] | None, quick: bool = False, deadline: float | None = None
) -> float:
    """Lower bound on max over ranks of the span, for schedules within ``limit`` (None: no limit).
    ``quick``: without the chain bound (the slow one: seconds at p=32, m=256), which is also
    left out if it is still running at ``deadline``, and with the area bound's LP relaxation
    (also on the ranks still left at ``deadline``) instead of its integer program."""
    return max(_rank_bounds(cost, num_microbatches, limit, quick, deadline))


def memory_iteration_lower_bound(
    cost: CostModel, num_microbatches: int, limit: list[float] | None, quick: bool = False, deadline: float | None = None
) -> float:
    """Lower bound on the longest per-rank iteration within ``limit``: per rank, the least its
    reductions and optimizer steps let it end given its span's bound (``rank_iteration_lower_bounds``)
    (``quick``, ``deadline``: as for ``memory_span_lower_bound``)."""
    spans = _rank_bounds(cost, num_microbatches, limit, quick, deadline)
    return max(rank_iteration_lower_bounds(cost, num_microbatches, spans))


@_paired_floor
def rank_iteration_lower_bounds(cost: CostModel, num_microbatches: int, spans: list[float]) -> list[float]:
    """Per rank, a lower bound on its iteration from ``spans``, lower bounds on its span: its
    last pass is one of its stages' last backward (W or BW), whose reduction follows it; on a
    rank with several stages each stage's last backward also ends no earlier than its own bound
    (``rank_backward_end_lower_bounds``), so a stage that finishes before the last one leaves
    its reduction on the lane before the last one's (``reductions.iteration_floor``). Where
    sharded stages gather, the rank's first pass is its lowest stage's (every other stage's
    forwards need it), whose gather runs first on the lane: the step starts that much before
    the first pass at least. Without reductions, the spans."""
    from .reductions import iteration_floor

    if not cost.has_reductions:
        return list(spans)
    ends = rank_backward_end_lower_bounds(cost, num_microbatches)
    gather = [cost.t_gather[min(cost.rank_stages(r))] if cost.t_gather else 0.0 for r in range(cost.num_ranks)]
    return [iteration_floor(b, e, cost.t_reduce, cost.t_opt) + g for b, e, g in zip(spans, ends, gather)]


@_paired_floor
def rank_backward_end_lower_bounds(cost: CostModel, num_microbatches: int) -> list[dict[int, float]]:
    """Per rank, per stage it holds, a lower bound on when the stage's last backward (its last
    W or BW) ends, from the rank's first start: the Carlier bound of ``rank_span_lower_bounds``
    with tails to that stage's backward only (the pass types that must precede it, on any
    rank). On a rank with one stage that is its span: the stage is left at 0 there, which
    ``iteration_floor`` does not need."""
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W (a BW is a B then a W here)
    preds = type_graph(cost)
    out: list[dict[int, float]] = []
    for r in range(cost.num_ranks):
        stages = cost.rank_stages(r)
        if len(stages) == 1:
            out.append({stages[0]: 0.0})
            continue
        rel = earliest_starts(cost, (min(stages), Op.F), preds)
        mine: dict[int, float] = {}
        for s in stages:
            tail = _tails(cost, {(s, Op.W)}, preds)
            mine[s] = _best_carlier(cost, preds, rel, tail, num_microbatches)
        out.append(mine)
    return out


def _rank_bounds(
    cost: CostModel, num_microbatches: int, limit: list[float] | None, quick: bool = False, deadline: float | None = None
) -> list[float]:
    """Per rank, the best of the bounds in this module (``quick``: all but the chain bound, the
    area and relay bounds relaxed); where the costs offer recomputation, the memory-aware ones replaced by
    the area bound; where pairs may form, raised to ``rank_pairing_span_lower_bounds``."""
    out = _with_pairing(cost, num_microbatches, rank_span_lower_bounds(cost, num_microbatches), limit)
    cost = cost.paired_floor()
    memory = None if cost.can_recompute else limit  # their memory reasoning assumes no recomputation
    chain = None if quick else rank_chain_span_lower_bounds(cost, num_microbatches, memory, deadline)
    if chain is not None:
        out = [max(a, b) for a, b in zip(out, chain)]
    if memory is not None:
        out = [max(a, b) for a, b in zip(out, rank_memory_span_lower_bounds(cost, num_microbatches, memory))]
    if limit is not None:
        area = rank_area_span_lower_bounds(cost, num_microbatches, limit, whole=not quick, deadline=deadline)
        relay = rank_relay_span_lower_bounds(cost, num_microbatches, limit, whole=not quick, deadline=deadline)
        deferral = rank_deferral_span_lower_bounds(cost, num_microbatches, limit)
        out = [max(a, b, c, d) for a, b, c, d in zip(out, area, relay, deferral)]
    return out


def memory_makespan_lower_bound(
    cost: CostModel, num_microbatches: int, limit: list[float] | None, quick: bool = False, deadline: float | None = None
) -> float:
    """Lower bound on the makespan within ``limit`` (None: no limit): rank r cannot start before
    the forwards of one microbatch reach it, and then needs at least its span bound
    (``quick``, ``deadline``: as for ``memory_span_lower_bound``)."""
    return makespan_from_spans(cost, num_microbatches, _rank_bounds(cost, num_microbatches, limit, quick, deadline))


@_paired_floor
def makespan_from_spans(cost: CostModel, num_microbatches: int, spans: list[float]) -> float:
    """Lower bound on the makespan from sound per-rank span bounds ``spans``: rank r cannot start
    before the forwards of one microbatch reach it, and then needs at least its span; never
    below ``makespan_lower_bound``."""
    cost = cost.for_bounds()  # fused BW passes may be cheaper than B + W
    best = makespan_lower_bound(cost, num_microbatches)
    rel = earliest_starts(cost, (0, Op.F), type_graph(cost))
    for r, span in enumerate(spans):
        best = max(best, rel[(min(cost.rank_stages(r)), Op.F)] + span)
    return best
