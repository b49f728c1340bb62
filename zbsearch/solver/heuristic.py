"""Constructive heuristics: memory-aware list scheduling on the true per-stage costs.

The list scheduler replays the pipeline in time. Whenever a rank is free it picks among the
next F, B and W of each of its stages (FIFO, see ``problem``) by a ``Policy``:

* a ready B runs first: it is on the critical path and frees memory;
* an F of the rank's first stage runs while fewer than ``cap[r]`` microbatches are in flight
  on the rank (the warm-up depth; ZB-H1 uses p - r, ZB-H2 about twice that) and its
  activations fit: an F must leave room for one F on each later stage of its rank, so that
  with several chunks the oldest microbatch can always finish its forwards (no deadlock);
* a W runs before an F when more than ``lag[r]`` W passes are pending on the rank (ZB-H1 lags
  rank r's W by r microbatches, ZB-H2 by 2r), when memory blocks the F, or when nothing else
  is ready; with ``fit`` a W only starts when it ends before the next known B arrives, so W
  fills gaps instead of delaying the critical path;
* with ``wait_b`` > 0 a rank leaves an F for a B that arrives within wait_b * T_F, and for its
  very first B within ``wait_first`` * T_F: that B starts the flow of backwards up the
  pipeline, and each rank that makes it wait delays every rank above it;
* with ``fuse`` >= 0 the backwards on a stage where a fused one costs less than a split one
  (t_ff + t_bw < t_f + t_b + t_w) run as one BW, but for the last ``fuse`` * (S - 1 - s) / v
  microbatches of stage s (v chunks per rank): those are split, as the cool-down of 1F1B
  leaves bubbles that their W passes fill, and their B passes carry the gradient down sooner
  where t_b < t_bw. ``fuse`` = 0 is the 1F1B family's passes, with the warm-up depth and
  memory awareness of the others. The local search then fuses or splits further.

Where the problem allows recomputation (``Problem.recompute``), each rank plans how its
microbatches in flight hold their activations (``_plan``): of the N in flight on a stage (its
warm-up depth, or its round trip in microbatches; ``plan_depth`` scales it), how many run
plain, checkpointed for selective or for full recomputation, for the least recompute time
whose memory fits the limit. Microbatch j takes the plan's (j mod N)-th choice, or, where that
does not fit at the time, the choice that keeps less. "full" checkpoints every forward. Each F
leaves room for rebuilding the oldest checkpointed microbatch of each stage of its rank, so it
can always be rebuilt. A recompute pass runs for the microbatch whose B comes next on its
stage: at once when that B's input is there, ahead of it when the input is due within
``prefetch`` times the pass's time (so the B starts as soon as the input arrives), or
whenever the rank would otherwise wait.

The knobs are the structure of the classic schedules (ZB-H1, ZB-H2, the paper's heuristic)
made continuous; ``candidate_policies`` is the grid the solver tries, keeping the best, and
``refine_waits`` then tries every value of the two wait knobs that changes the schedule
(``sweep_waits``): which ranks should let an F go for the first B depends on how the ranks' F
streams are phased against the chain of backwards, which a fixed grid samples at random. Times
are compared with a tolerance of ``REL_TOL`` of a pass: a B whose inputs arrive a rounding error
after the rank frees is ready, not left behind an F or a W. The
sequential schedule (one microbatch at a time through the whole pipeline) needs only one
microbatch's activations per rank and is the fallback at the tightest limits.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from .. import clock as timing
from ..actions import RECOMPUTES, Action, Op
from ..dependencies import earliest_starts, edge_delay, successors, type_graph
from ..tolerances import REL_TOL
from .problem import Problem

__all__ = ["Policy", "list_schedule", "sweep_waits", "refine_waits", "sequential_schedule", "candidate_policies"]

_INF = float("inf")
WaitKnob = Literal["wait_first", "wait_b"]  # the Policy fields that say how long an F waits for a B
_CHECK_EVERY = 512  # decisions between looks at the clock
_F, _B, _W = Op.F, Op.B, Op.W  # bound once: the list scheduler's loop reads them a lot


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Knobs of the list scheduler (see the module docstring); built by keyword."""

    depth: float = _INF  # warm-up depth as a multiple of the rank's round trip in microbatches
    lag: float = _INF  # pending-W allowance per rank position (lag[r] = lag * r)
    fit: bool = False  # W also where it fits a gap before the next pass
    wait_b: float = 0.0  # wait up to wait_b * T_F for a B rather than start an F
    wait_first: float = 0.0  # the same for a rank's first B
    fuse: float = -1.0  # < 0: every backward split; else fused but for a tail (module docstring)
    plan_depth: float = 1.0  # recomputation: plan for this multiple of the microbatches in flight
    prefetch: float = 1.0  # recomputation: rebuild when the B's input is due within this many recompute times

    @property
    def name(self) -> str:
        """The policy's knobs in words, as ``solve`` reports which construction won."""
        d = "mem" if self.depth == _INF else f"{self.depth:g}"
        g = "inf" if self.lag == _INF else f"{self.lag:g}"
        return (
            f"list(depth={d}, lag={g}{', fit' if self.fit else ''}{f', wait={self.wait_b:g}' if self.wait_b else ''}"
            f"{f', first={self.wait_first:g}' if self.wait_first else ''}"
            f"{'' if self.fuse < 0 else ', fused' if self.fuse == 0 else f', fused but tail {self.fuse:g}'}"
            f"{f', plan {self.plan_depth:g}' if self.plan_depth != 1 else ''}"
            f"{f', prefetch {self.prefetch:g}' if self.prefetch != 1 else ''})"
        )


def _cheapest_mix(cost, s: int, ways: list[Op | None], n: int, budget: float) -> list[Op | None]:
    """n choices among ``ways`` (plain first, then recompute passes keeping less and less) with
    the least recompute time whose memory (what each keeps, plus room to rebuild the one that
    keeps least) fits ``budget``; all of the way that keeps least where none fits. Ordered
    plain first, then by the memory kept."""
    def held(op: Op | None) -> float:
        return cost.m_f[s] if op is None else cost.offer(s, op).keep

    def extra(op: Op | None) -> float:
        return 0.0 if op is None else cost.offer(s, op).t_r + cost.offer(s, op).t_f - cost.t_f[s]

    best: tuple[float, float, list[Op | None]] | None = None
    k = len(ways)
    # counts of the ways, as compositions of n into k parts (k <= 3)
    for split in _compositions(n, k):
        mix = [w for w, c in zip(ways, split) for _ in range(c)]
        ckpt = [w for w in mix if w is not None]
        mem = sum(held(w) for w in mix) + (max(cost.m_f[s] - held(w) for w in ckpt) if ckpt else 0.0)
        if mem > budget:
            continue
        key = (sum(extra(w) for w in mix), mem, mix)
        if best is None or key[:2] < best[:2]:
            best = key
    return best[2] if best is not None else [ways[-1]] * n


def _compositions(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every way to write n as k counts >= 0."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def fused_pays(problem: Problem) -> list[bool]:
    """Per stage, whether a fused backward (and the forward before it) costs less than a split one."""
    c = problem.cost
    return [c.t_ff[s] + c.t_bw[s] < c.t_f[s] + c.t_b[s] + c.t_w[s] for s in range(c.num_stages)]


def candidate_policies(problem: Problem | None = None) -> list[Policy]:
    """The grid the solver tries, the most often best first (on the paper's profiles): ZB-H1-
    like shallow warm-ups with prompt W, deeper warm-ups with W deferred, with and without
    waiting for backwards. Given a problem where a fused backward costs less than a split one
    on some stage, each policy also fused (``fuse`` 0) and fused but for its cool-down tail
    (``fuse`` 1; the most often best ones also 2), interleaved with the split ones: first
    where fusing pays on every stage."""
    grid = _grid()
    if problem is not None and problem.recompute != "none" and problem.cost.can_recompute:
        # checkpoint only past a share of the limit, and rebuild just in time or ahead
        grid = [replace(p, plan_depth=depth, prefetch=pre) for p in grid for depth, pre in _RECOMPUTE_KNOBS]
    pays = fused_pays(problem) if problem is not None else []
    if not any(pays):
        return grid
    out = []
    for k, p in enumerate(grid):
        fused = [replace(p, fuse=x) for x in ((1.0, 0.0, 2.0) if k < _FIRST else (1.0, 0.0))]
        out += fused + [p] if all(pays) else [p] + fused
    return out


_FIRST = 8  # the grid's first policies, the most often best
_RECOMPUTE_KNOBS = ((1.0, 1.0), (1.0, 0.0), (1.5, 1.0))  # (plan_depth, prefetch) tried with each policy


def _grid() -> list[Policy]:
    first = [
        Policy(depth=2.0, wait_first=0.5), Policy(depth=1.0, lag=1.0, fit=True),
        Policy(depth=2.0, wait_first=1.0), Policy(depth=1.0, lag=2.0, fit=True),
        Policy(depth=2.0, wait_b=0.15, wait_first=0.5), Policy(depth=2.0, wait_b=0.15, wait_first=1.0),
        Policy(depth=1.5, fit=True, wait_b=0.15, wait_first=0.5), Policy(depth=1.5, fit=True, wait_b=0.15, wait_first=1.0),
    ]
    rest = [Policy(depth=1.0, lag=lag, fit=fit) for lag in (1.0, 2.0, _INF) for fit in (False, True)]
    rest += [
        Policy(depth=depth, fit=fit, wait_b=wait_b, wait_first=wait_first)
        for depth in (1.5, 2.0, _INF) for fit in (False, True) for wait_b in (0.0, 0.15) for wait_first in (0.0, 0.5, 1.0)
    ]
    return first + [p for p in rest if p not in first]


def _round_trip(problem: Problem) -> list[float]:
    """Per rank: time from the start of F on its first stage to the end of B there, with no waiting."""
    c = problem.cost
    S = c.num_stages
    out = []
    # Summed as below, not as a path in dependencies.type_graph: float rounding decides ties in
    # the warm-up depths (round(depth * trip / per_mb)), so the order of the sums is part of the
    # heuristic's results.
    for r in range(c.num_ranks):
        s0 = min(c.rank_stages(r))
        t = sum(c.t_f[s] for s in range(s0, S)) + sum(c.t_b[s] for s in range(s0, S))
        t += 2 * sum(edge_delay(c, s, s + 1) for s in range(s0, S - 1))
        out.append(t)
    return out


def list_schedule(
    problem: Problem, policy: Policy, deadline: float | None = None
) -> tuple[list[list[Action]], float] | None:
    """Per-rank action lists built by ``policy`` and the objective of the times it assigned
    (never below the simulated one but for that tolerance: the simulator starts each pass
    as early as the order allows), or None when the policy gets stuck on memory or is still running at ``deadline``
    (a ``deadline.now()`` instant; None: no deadline)."""
    out = _ListScheduler(problem, policy).run(deadline)
    # the work clock counts a run as a simulation of every pass (it times each once)
    timing.simulated(3 * problem.num_microbatches * problem.cost.num_stages)
    return out


class _Start(NamedTuple):
    """Start the next pass of (stage, op) now (an F checkpointed for recompute pass ``ckpt``)."""

    stage: int
    op: Op
    ckpt: Op | None = None


class _Wait(NamedTuple):
    """Start nothing; look again at ``until`` (inf: when another rank's pass wakes this one)."""

    until: float


class _ListScheduler:
    """One run of the list scheduler: a clock per rank, passes started in time order.

    ``run`` pops the rank that is free earliest, asks ``choose`` what it does next and
    ``apply``s it. Each stage runs its passes of one kind in microbatch order, so its next
    F, B or W is ``n_f[s]``, ``n_b[s]``, ``n_w[s]``; ``forward_start`` and ``backward_start``
    say when it can start. With ``policy.fuse`` >= 0 the backwards of microbatches below
    ``fuse_below[s]`` on stage s run as one BW (t_bw, memory m_b + m_w, their W done with it)
    and their F costs t_ff; the fused ones come first on each stage, so the W passes still pending
    are the split ones, in microbatch order."""

    def __init__(self, problem: Problem, policy: Policy) -> None:
        c, m = problem.cost, problem.num_microbatches
        self.fuse_below = [0] * c.num_stages  # microbatches below it fused, per stage
        if policy.fuse >= 0:
            chunks = c.num_stages // c.num_ranks
            self.fuse_below = [max(0, m - math.ceil(policy.fuse * (c.num_stages - 1 - s) / chunks)) if pays else 0
                               for s, pays in enumerate(fused_pays(problem))]
        S, R = c.num_stages, c.num_ranks
        self.cost, self.m, self.S, self.policy, self.objective = c, m, S, policy, problem.objective
        self.limit = problem.allowed()
        # inputs arriving within eps of now count as there: sums of pass and comm times round
        self.eps = REL_TOL * max(max(c.t_f), max(c.t_b), max(c.t_w))
        self.stages = [sorted(c.rank_stages(r)) for r in range(R)]
        self.rank_of = c.stage_to_rank
        # memory an F on stage s must leave room for beyond its own: one F on each later stage of
        # its rank (so that the oldest microbatch can always finish its forwards: no deadlock)
        self.later = [sum(c.m_f[t] for t in self.stages[self.rank_of[s]] if t > s) for s in range(S)]
        trip = _round_trip(problem)
        self.cap: list[float] = []  # warm-up depth per rank (microbatches in flight)
        self.lag: list[float] = []  # pending-W allowance per rank
        for r in range(R):
            per_mb = sum(c.t_f[s] + c.t_b[s] for s in self.stages[r])
            self.cap.append(math.inf if policy.depth == _INF else max(1, round(policy.depth * trip[r] / per_mb)))
            self.lag.append(math.inf if policy.lag == _INF else round(policy.lag * r))
        # ranks other than the pass's own that wait for it, with the edge delay: (rank, delay)
        self.wakes = {
            (s, op): [
                (self.rank_of[t], edge_delay(c, s, t))
                for t, _, _ in successors(s, op, 0, S)
                if self.rank_of[t] != self.rank_of[s]
            ]
            for s in range(S) for op in (Op.F, Op.B, Op.W, *RECOMPUTES)
        }
        self.b_feeds_other_rank = [bool(self.wakes[(s, Op.B)]) for s in range(S)]
        # recomputation: per stage the ways to hold a microbatch, plain (None) first, then the
        # recompute passes offered, the least memory kept last; the plan; per microbatch the
        # way chosen; per stage the checkpointed microbatches not yet rebuilt, oldest first
        self.full = problem.recompute == "full"
        self.ways: list[list[Op | None]] = []
        for s in range(S):
            plain: list[Op | None] = [] if self.full else [None]
            passes = sorted(c.recompute_ops(s), key=lambda op: -c.offer(s, op).keep)  # type: ignore[union-attr]
            self.ways.append(plain + list(passes))
        self.offers_any = any(len(w) > 1 or w[0] is not None for w in self.ways if w)
        self.plan = self._plan() if self.offers_any else [[None] for _ in range(S)]
        self.ckpt: list[list[Op | None]] = [[None] * m for _ in range(S)]
        self.rebuilt = [[False] * m for _ in range(S)]
        self.waiting: list[deque[Op]] = [deque() for _ in range(S)]
        # Offsets along one microbatch's chain with no waiting: F(s) starts f_offset[s] after
        # F(0), B(s) starts b_offset[s] after B(S-1).
        graph = type_graph(c)
        from_f0, from_last_b = earliest_starts(c, (0, Op.F), graph), earliest_starts(c, (S - 1, Op.B), graph)
        self.f_offset = [from_f0[(s, Op.F)] for s in range(S)]
        self.b_offset = [from_last_b[(s, Op.B)] for s in range(S)]

        self.n_f, self.n_b, self.n_w = [0] * S, [0] * S, [0] * S  # passes run per stage
        self.end_f = [[0.0] * m for _ in range(S)]
        self.end_b = [[0.0] * m for _ in range(S)]
        # the inputs of each stage's F and B: (runs of that kind, their ends, stage, edge delay)
        runs = {Op.F: (self.n_f, self.end_f), Op.B: (self.n_b, self.end_b)}
        self.inputs = {
            op: [[(*runs[dop], ds, delay) for (ds, dop), delay in graph[(s, op)]] for s in range(S)] for op in (Op.F, Op.B)
        }
        self.deepest_f = [-1] * m  # per microbatch: deepest stage whose F has run
        self.lowest_b = [S] * m  # per microbatch: lowest stage whose B has run
        self.free = [0.0] * R  # when each rank's last pass ends
        self.first = [_INF] * R  # when each rank's first pass starts
        self.memory = [0.0] * R
        self.rows: list[list[Action]] = [[] for _ in range(R)]
        # per wait knob: the least value that would have flipped one of this run's decisions
        # from starting an F to waiting for a B
        self.flips: dict[WaitKnob, float] = {"wait_first": _INF, "wait_b": _INF}

    # ---- the loop ----------------------------------------------------------------------

    def run(self, deadline: float | None = None) -> tuple[list[list[Action]], float] | None:
        remaining = 3 * self.S * self.m
        heap = [(0.0, r) for r in range(len(self.rows))]
        free, wakes, choose, apply = self.free, self.wakes, self.choose, self.apply  # hot loop
        check = _CHECK_EVERY
        while remaining:
            if not heap:
                return None  # every rank waits for memory that only a blocked rank could free
            check -= 1
            if not check:
                if deadline is not None and timing.now() > deadline:
                    return None  # cut: the caller has a fallback
                check = _CHECK_EVERY
            t, r = heapq.heappop(heap)
            if t < free[r]:
                continue
            decision = choose(r, t)
            if isinstance(decision, _Wait):
                if decision.until < _INF:
                    heapq.heappush(heap, (decision.until, r))
                continue
            end = apply(r, t, decision)
            for r2, delay in wakes[(decision.stage, decision.op)]:
                heapq.heappush(heap, (max(free[r2], end + delay), r2))
            done = self.rows[r][-1].op
            remaining -= 2 if done is Op.BW else 0 if done in RECOMPUTES else 1  # a BW does its W too
            heapq.heappush(heap, (end, r))
        if self.objective != "makespan":  # span, or iteration: timed further by the simulator
            return self.rows, max(f - s for f, s in zip(self.free, self.first))
        return self.rows, max(self.free)

    def choose(self, r: int, t: float) -> _Start | _Wait:
        """What rank r does at time t: a ready B first (its recompute pass first where it has
        one), then W if the policy or memory says so, then a recompute pass due soon, then F
        (unless a B is about to arrive), then W, else a recompute pass, else wait."""
        best_b, next_b = self.ready_backward(r, t)
        soon = None
        if self.offers_any:
            urgent, soon = self.due_recompute(r, t)
            if urgent is not None:  # its B's input is here: rebuild its activations now
                start = self.recompute_pass(urgent)
                if start is not None:
                    return start
                best_w, _ = self.oldest_weight(r)
                return _Start(best_w, _W) if best_w is not None else _Wait(_INF)  # W frees the room
        if best_b is not None:
            return _Start(best_b, _B)
        if soon is not None and soon[1] <= t + self.policy.prefetch * self.r_time(soon[0]):
            start = self.recompute_pass(soon[0])
            if start is not None:
                return start
        best_f, f_blocked, next_f = self.ready_forward(r, t)
        best_w, pending_w = self.oldest_weight(r)
        if best_w is not None and (f_blocked or pending_w > self.lag[r]):
            return _Start(best_w, _W)
        if best_f is not None:
            if t < next_b < _INF:
                stages, n_b, policy = self.stages[r], self.n_b, self.policy
                knob: WaitKnob = "wait_first" if n_b[stages[0]] == 0 and n_b[stages[-1]] == 0 else "wait_b"
                wait = getattr(policy, knob)
                if next_b <= t + wait * self.cost.t_f[best_f[0]]:
                    return _Wait(next_b)
                # the least value of this knob that would have waited here (see ``sweep_waits``)
                self.flips[knob] = min(self.flips[knob], (next_b - t) / self.cost.t_f[best_f[0]])
            return _Start(best_f[0], _F, best_f[1])
        nxt = min(next_b, next_f)
        if best_w is not None:
            if self.policy.fit and t < nxt < t + self.cost.t_w[best_w]:
                return _Wait(nxt)
            return _Start(best_w, _W)
        if soon is not None:  # nothing else to do: rebuild ahead
            start = self.recompute_pass(soon[0])
            if start is not None:
                return start
        return _Wait(nxt if nxt > t else _INF)

    # ---- recomputation ---------------------------------------------------------------

    def r_time(self, s: int) -> float:
        """Time of the recompute pass the next B on stage s needs."""
        op = self.ckpt[s][self.n_b[s]]
        assert op is not None
        return self.cost.time(s, op)

    def due_recompute(self, r: int, t: float) -> tuple[int | None, tuple[int, float] | None]:
        """(a stage whose next B has its input but not its activations, or None; (stage, when
        its input is due) of the soonest such B whose input is not there yet, or None)."""
        urgent, soon = None, None
        n_b, n_f, inputs = self.n_b, self.n_f, self.inputs[_B]
        for s in self.stages[r]:
            j = n_b[s]
            if j >= self.m or n_f[s] <= j or self.ckpt[s][j] is None or self.rebuilt[s][j]:
                continue
            arrival = self.arrival(inputs[s], j)
            if arrival is not None and arrival <= t + self.eps:
                if urgent is None or (j, -s) < (n_b[urgent], -urgent):
                    urgent = s
            else:
                eta = max(self.backward_start(s, j, arrival), t)
                if soon is None or eta < soon[1]:
                    soon = (s, eta)
        return urgent, soon

    def recompute_pass(self, s: int) -> _Start | None:
        """Rebuild the activations of the next B on stage s, if they fit."""
        op = self.ckpt[s][self.n_b[s]]
        assert op is not None
        r = self.rank_of[s]
        if self.memory[r] + self.cost.memory(s, op) > self.limit[r]:
            return None
        return _Start(s, op)

    def need(self, s: int, op: Op | None = None) -> float:
        """Room the oldest checkpointed microbatch waiting on stage s needs to be rebuilt (or,
        where none waits, one checkpointed for ``op``; 0 for none)."""
        if self.waiting[s]:
            op = self.waiting[s][0]
        return 0.0 if op is None else self.cost.memory(s, op)

    def forward_kind(self, r: int, s: int) -> tuple[bool, Op | None]:
        """(whether the next F on stage s fits, the recompute pass it is checkpointed for or None):
        the plan's choice for its microbatch, else the first that keeps less and fits."""
        c, mem, lim = self.cost, self.memory[r], self.limit[r]
        if not self.offers_any:
            return mem + c.m_f[s] + self.later[s] <= lim, None
        others = sum(self.need(t) for t in self.stages[r] if t != s)
        ways = self.ways[s]
        planned = self.plan[s][self.n_f[s] % len(self.plan[s])]
        for op in ways[ways.index(planned):] if planned in ways else ways:
            held = c.m_f[s] if op is None else c.offer(s, op).keep  # type: ignore[union-attr]
            if mem + held + self.later[s] + others + self.need(s, op) <= lim:
                return True, op
        return False, None

    def _plan(self) -> list[list[Op | None]]:
        """Per stage, how the microbatches in flight hold their activations: N choices, N the
        microbatches in flight on the stage (its round trip in microbatches of the rank, times
        ``plan_depth``, at most the rank's warm-up depth), as many of each way (plain, or checkpointed for a
        recompute pass) as give the least recompute time within the rank's limit, its memory
        shared among its stages in proportion to what their microbatches in flight hold plain;
        the cheapest ways first."""
        c, m = self.cost, self.m
        graph = type_graph(c)
        plan: list[list[Op | None]] = [[] for _ in range(self.S)]
        for r, stages in enumerate(self.stages):
            per_mb = sum(c.t_f[s] + c.t_b[s] for s in stages)
            count = {}
            for s in stages:
                lag = earliest_starts(c, (s, Op.F), graph)[(s, Op.B)] + c.t_b[s]
                count[s] = int(max(1, min(m, self.cap[r], round(self.policy.plan_depth * lag / per_mb))))
            total = sum(count[s] * c.m_f[s] for s in stages) or 1.0
            for s in stages:
                budget = self.limit[r] * count[s] * c.m_f[s] / total
                plan[s] = _cheapest_mix(c, s, self.ways[s], count[s], budget)
        return plan

    def apply(self, r: int, t: float, start: _Start) -> float:
        """Run the pass from t on rank r; its end time."""
        s, op, c = start.stage, start.op, self.cost
        kind = op
        if op is _F and start.ckpt is not None:
            j = self.n_f[s]
            offer = c.offer(s, start.ckpt)
            assert offer is not None
            end = self.end_f[s][j] = t + offer.t_f
            self.n_f[s] += 1
            self.deepest_f[j] = s
            self.memory[r] += offer.keep
            self.ckpt[s][j] = start.ckpt
            self.waiting[s].append(start.ckpt)
        elif op in RECOMPUTES:
            j = self.n_b[s]
            offer = c.offer(s, op)
            assert offer is not None
            end = t + offer.time(fused=j < self.fuse_below[s])  # before a BW: the plain forward
            self.memory[r] += c.memory(s, op)
            self.rebuilt[s][j] = True
            self.waiting[s].popleft()
        elif op is _F:
            j = self.n_f[s]
            end = self.end_f[s][j] = t + (c.t_ff[s] if j < self.fuse_below[s] else c.t_f[s])
            self.n_f[s] += 1
            self.deepest_f[j] = s
            self.memory[r] += c.m_f[s]
        elif op is _B:
            j = self.n_b[s]
            self.n_b[s] += 1
            self.lowest_b[j] = s
            if j < self.fuse_below[s]:  # a BW: its W is done with it
                end = self.end_b[s][j] = t + c.t_bw[s]
                self.n_w[s] += 1
                self.memory[r] += c.m_b[s] + c.m_w[s]
                kind = Op.BW
            else:
                end = self.end_b[s][j] = t + c.t_b[s]
                self.memory[r] += c.m_b[s]
        else:
            j = self.n_w[s]
            end = t + c.t_w[s]
            self.n_w[s] += 1
            self.memory[r] += c.m_w[s]
        self.rows[r].append(Action(s, kind, j))
        self.first[r] = min(self.first[r], t)
        self.free[r] = end
        return end

    # ---- the candidates ----------------------------------------------------------------

    def ready_backward(self, r: int, t: float) -> tuple[int | None, float]:
        """(stage of the B to start at t, oldest microbatch first, or None; the earliest
        start of a B that another rank waits for, inf if none). A B whose microbatch is
        checkpointed is ready once its activations are rebuilt."""
        best, next_b = None, _INF
        n_b, n_f, inputs = self.n_b, self.n_f, self.inputs[_B]
        for s in self.stages[r]:
            j = n_b[s]
            if j >= self.m or n_f[s] <= j:
                continue
            if self.ckpt[s][j] is not None and not self.rebuilt[s][j]:
                continue
            arrival = self.arrival(inputs[s], j)
            if arrival is not None and arrival <= t + self.eps:
                if best is None or (j, -s) < (n_b[best], -best):
                    best = s
            elif self.b_feeds_other_rank[s]:
                next_b = min(next_b, max(self.backward_start(s, j, arrival), t))
        return best, next_b

    def ready_forward(self, r: int, t: float) -> tuple[tuple[int, Op | None] | None, bool, float]:
        """((stage, recompute pass it is checkpointed for or None) of the F to start at t,
        oldest microbatch first, or None; whether memory blocks an F; the earliest start of an
        F not ready yet, inf if none)."""
        best: tuple[int, Op | None] | None = None
        blocked, next_f = False, _INF
        s0, n_f, inputs = self.stages[r][0], self.n_f, self.inputs[_F]
        for s in self.stages[r]:
            j = n_f[s]
            if j >= self.m or (s == s0 and j - self.n_b[s0] >= self.cap[r]):
                continue
            fits, ckpt = self.forward_kind(r, s)
            if not fits:
                blocked = True
                continue
            arrival = self.arrival(inputs[s], j)
            if arrival is None or arrival > t + self.eps:
                next_f = min(next_f, max(self.forward_start(s, j, arrival), t))
            elif best is None or (j, -s) < (n_f[best[0]], -best[0]):
                best = (s, ckpt)
        return best, blocked, next_f

    def oldest_weight(self, r: int) -> tuple[int | None, int]:
        """(stage of the pending W of the oldest microbatch, or None; how many W are pending)."""
        best, pending = None, 0
        n_b, n_w = self.n_b, self.n_w
        for s in self.stages[r]:
            pending += n_b[s] - n_w[s]
            if n_w[s] < n_b[s] and (best is None or n_w[s] < n_w[best]):
                best = s
        return best, pending

    def arrival(self, inputs: list, j: int) -> float | None:
        """When every input of a stage's next pass is there (``dependencies.input_arrival`` on
        this scheduler's tables; ``inputs``: ``self.inputs[op][s]``); None while one has not run."""
        t = 0.0
        for runs, ends, ds, delay in inputs:
            if runs[ds] <= j:
                return None
            t = max(t, ends[ds][j] + delay)
        return t

    def forward_start(self, s: int, j: int, arrival: float | None) -> float:
        """Start time of F(s, j): ``arrival`` once its input has run, else a lower bound from
        the deepest F of microbatch j so far."""
        if arrival is not None:
            return arrival
        d = self.deepest_f[j]
        if d < 0:
            return _INF
        return self.end_f[d][j] - self.cost.t_f[d] + self.f_offset[s] - self.f_offset[d]

    def backward_start(self, s: int, j: int, arrival: float | None) -> float:
        """Start time of B(s, j) (its F has run): ``arrival`` once its inputs have run, else a
        lower bound from the lowest B, or the deepest F, of microbatch j so far."""
        if arrival is not None:
            return arrival
        b, S = self.lowest_b[j], self.S
        if b < S:
            return self.end_b[b][j] - self.cost.t_b[b] + self.b_offset[s] - self.b_offset[b]
        d, f_off = self.deepest_f[j], self.f_offset
        return self.end_f[d][j] - self.cost.t_f[d] + f_off[S - 1] - f_off[d] + self.cost.t_f[S - 1] + self.b_offset[s]


# How far ``sweep_waits`` goes, per knob, in units of the F that would wait: a first B is worth
# waiting up to about two forwards for (it starts the flow of backwards), a later one one.
_SWEEP_UPTO: dict[WaitKnob, float] = {"wait_first": 2.0, "wait_b": 1.0}
# Relative step past a breakpoint: the comparison at the breakpoint itself may round either way.
_NUDGE = REL_TOL


def sweep_waits(
    problem: Problem, policy: Policy, knob: WaitKnob, deadline: float | None = None
) -> Iterator[tuple[Policy, list[list[Action]], float]]:
    """Every distinct list schedule of ``policy`` as its ``knob`` (``wait_first`` or ``wait_b``)
    runs over [0, upto], in increasing order of the knob: (policy, rows, value as
    ``list_schedule`` gives them).

    Why: how long a rank should leave an F for an arriving B depends on how the F streams of
    all ranks are phased against the chain of backwards, which a fixed grid of knob values
    samples at random. But a run depends on the knob only through its comparisons "B arrives
    within knob * T_F": with the knob at x, every comparison that did not wait had a ratio
    (B arrival - now) / T_F above x, and up to the least of them (``flips``) every comparison,
    hence the whole run, comes out the same. So stepping from one such breakpoint to the next
    meets every schedule the knob can give, one list schedule per interval of the knob on
    which the run stays the same. A run cut by ``deadline`` ends the sweep; a run stuck on
    memory is skipped."""
    x, upto = 0.0, _SWEEP_UPTO[knob]
    while True:
        pol = replace(policy, wait_first=x) if knob == "wait_first" else replace(policy, wait_b=x)
        if deadline is not None and timing.now() > deadline:
            return
        run = _ListScheduler(problem, pol)
        out = run.run(deadline)
        if out is not None:
            yield pol, *out
        elif deadline is not None and timing.now() > deadline:
            return
        nxt = run.flips[knob]  # inf: no decision the knob could flip, every larger value gives this
        if x >= upto or nxt > upto:
            return
        x = min(upto, max(nxt, x) * (1 + _NUDGE) + _NUDGE)  # upto itself last: B exactly one F away


def refine_waits(
    problem: Problem, policy: Policy, value: float, deadline: float | None = None, target: float = -_INF
) -> tuple[Policy, list[list[Action]], float] | None:
    """``policy`` with better wait knobs, if any: each knob swept over all its values
    (``sweep_waits``) with the other fixed at its best so far, in turn, until neither finds a
    better schedule than the best so far (``value`` to start: ``policy``'s), the best reaches
    ``target`` (a lower bound) or ``deadline`` passes. The best (policy, rows, value) found,
    None if nothing beat ``value``."""
    best: tuple[Policy, list[list[Action]], float] | None = None
    knob: WaitKnob = "wait_first"
    idle = 0  # sweeps in a row that found nothing better
    while idle < 2 and value > target:
        base = best[0] if best is not None else policy
        better = False
        for pol, rows, v in sweep_waits(problem, base, knob, deadline):
            if v < value * (1 - _NUDGE):
                best, value, better = (pol, rows, v), v, True
                if value <= target:
                    break
        if deadline is not None and timing.now() > deadline:
            break
        idle = 0 if better else idle + 1
        knob = "wait_b" if knob == "wait_first" else "wait_first"
    return best


def sequential_schedule(problem: Problem) -> list[list[Action]]:
    """One microbatch at a time through the whole pipeline: each rank runs, per microbatch, its
    forwards, then its B passes each followed at once by its W. Peak memory per rank is one
    microbatch's activations, the least any schedule needs without recomputation.

    With recomputation ("auto"), a rank with several stages runs the forwards of all but its
    last checkpointed (by the offer that keeps least) wherever that lowers its peak, each
    recomputed just before its B: while the last stage's backward runs, the others hold only
    what they keep, the least any schedule needs. With "full", every forward is checkpointed
    and recomputed just before its B."""
    c, m = problem.cost, problem.num_microbatches
    rows = []
    for r in range(c.num_ranks):
        st = sorted(c.rank_stages(r))
        ckpt = _sequential_checkpoints(problem, st)
        row = []
        for j in range(m):
            row += [Action(s, Op.F, j) for s in st]
            for s in reversed(st):
                if s in ckpt:
                    row.append(Action(s, ckpt[s], j))
                row += [Action(s, Op.B, j), Action(s, Op.W, j)]
        rows.append(row)
    return rows


def _sequential_checkpoints(problem: Problem, stages: list[int]) -> dict[int, Op]:
    """Stage -> the recompute pass the sequential schedule uses on it (see there)."""
    c = problem.cost
    if problem.recompute == "full":
        return {s: Op.R for s in stages}
    if problem.recompute == "none" or len(stages) < 2:
        return {}
    ckpt: dict[int, Op] = {}
    for s in stages[:-1]:
        offers = [(c.offer(s, op).keep, op) for op in c.recompute_ops(s)]  # type: ignore[union-attr]
        if offers:
            ckpt[s] = min(offers)[1]

    def peak(chosen: dict[int, Op]) -> float:
        held, top = 0.0, 0.0
        keep = {s: c.offer(s, op).keep for s, op in chosen.items()}  # type: ignore[union-attr]
        for s in stages:
            held += keep.get(s, c.m_f[s])
            top = max(top, held)
        for s in reversed(stages):
            held += c.m_f[s] - keep.get(s, c.m_f[s])
            top = max(top, held)
            held += c.m_b[s]
            top = max(top, held)
            held += c.m_w[s]
            top = max(top, held)
        return top

    return ckpt if ckpt and peak(ckpt) < peak({}) else {}
