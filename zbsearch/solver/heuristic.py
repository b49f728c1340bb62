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
  pipeline, and each rank that makes it wait delays every rank above it.

The knobs are the structure of the classic schedules (ZB-H1, ZB-H2, the paper's heuristic)
made continuous; ``candidate_policies`` is the grid the solver tries, keeping the best. The
sequential schedule (one microbatch at a time through the whole pipeline) needs only one
microbatch's activations per rank and is the fallback at the tightest limits.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..actions import Action, Op
from .problem import Problem

__all__ = ["Policy", "list_schedule", "sequential_schedule", "candidate_policies"]

_INF = float("inf")


@dataclass(frozen=True)
class Policy:
    """Knobs of the list scheduler (see the module docstring)."""

    depth: float = _INF  # warm-up depth as a multiple of the rank's round trip in microbatches
    lag: float = _INF  # pending-W allowance per rank position (lag[r] = lag * r)
    fit: bool = False
    wait_b: float = 0.0
    wait_first: float = 0.0

    @property
    def name(self) -> str:
        d = "mem" if self.depth == _INF else f"{self.depth:g}"
        g = "inf" if self.lag == _INF else f"{self.lag:g}"
        return (
            f"list(depth={d}, lag={g}{', fit' if self.fit else ''}{f', wait={self.wait_b:g}' if self.wait_b else ''}"
            f"{f', first={self.wait_first:g}' if self.wait_first else ''})"
        )


def candidate_policies() -> list[Policy]:
    """The grid the solver tries, the most often best first (on the paper's profiles): ZB-H1-
    like shallow warm-ups with prompt W, deeper warm-ups with W deferred, with and without
    waiting for backwards."""
    first = [
        Policy(2.0, _INF, False, 0.0, 0.5), Policy(1.0, 1.0, True),
        Policy(2.0, _INF, False, 0.0, 1.0), Policy(1.0, 2.0, True),
        Policy(2.0, _INF, False, 0.15, 0.5), Policy(2.0, _INF, False, 0.15, 1.0),
        Policy(1.5, _INF, True, 0.15, 0.5), Policy(1.5, _INF, True, 0.15, 1.0),
    ]
    rest = [Policy(1.0, lag, fit) for lag in (1.0, 2.0, _INF) for fit in (False, True)]
    rest += [
        Policy(depth, _INF, fit, wait_b, wait_first)
        for depth in (1.5, 2.0, _INF) for fit in (False, True) for wait_b in (0.0, 0.15) for wait_first in (0.0, 0.5, 1.0)
    ]
    return first + [p for p in rest if p not in first]


def _round_trip(problem: Problem) -> list[float]:
    """Per rank: time from the start of F on its first stage to the end of B there, with no waiting."""
    c = problem.cost
    S = c.num_stages
    out = []
    for r in range(c.num_ranks):
        s0 = min(c.rank_stages(r))
        t = sum(c.t_f[s] for s in range(s0, S)) + sum(c.t_b[s] for s in range(s0, S))
        t += 2 * sum(c.comm(s, s + 1) for s in range(s0, S - 1))
        out.append(t)
    return out


def list_schedule(problem: Problem, policy: Policy) -> tuple[list[list[Action]], float] | None:
    """Per-rank action lists built by ``policy`` and the objective of the times it assigned
    (never below the simulated one: the simulator starts each pass as early as the order
    allows), or None when the policy gets stuck on memory."""
    c, m = problem.cost, problem.num_microbatches
    S, R = c.num_stages, c.num_ranks
    tf, tb, tw, mf, mb, mw, cn = c.t_f, c.t_b, c.t_w, c.m_f, c.m_b, c.m_w, c.comm_next
    limit = problem.allowed()
    stages = [sorted(c.rank_stages(r)) for r in range(R)]
    rank_of = c.stage_to_rank
    room = [sum(mf[t] for t in stages[rank_of[s]] if t >= s) for s in range(S)]
    trip = _round_trip(problem)
    cap, lag = [], []
    for r in range(R):
        per_mb = sum(tf[s] + tb[s] for s in stages[r])
        cap.append(math.inf if policy.depth == _INF else max(1, round(policy.depth * trip[r] / per_mb)))
        lag.append(math.inf if policy.lag == _INF else round(policy.lag * r))

    endF = [[0.0] * m for _ in range(S)]
    endB = [[0.0] * m for _ in range(S)]
    nF, nB, nW = [0] * S, [0] * S, [0] * S
    fd = [-1] * m  # per microbatch: deepest stage whose F has run
    bd = [S] * m  # per microbatch: lowest stage whose B has run
    # Offsets along one microbatch's chain with no waiting: F(s) starts A[s] after F(0),
    # B(s) starts G[s] after B(S-1).
    A = [0.0] * S
    for s in range(1, S):
        A[s] = A[s - 1] + tf[s - 1] + cn[s - 1]
    G = [0.0] * S
    for s in range(S - 2, -1, -1):
        G[s] = G[s + 1] + tb[s + 1] + cn[s]
    free = [0.0] * R
    first = [_INF] * R
    mem = [0.0] * R
    rows: list[list[Action]] = [[] for _ in range(R)]
    remaining = 3 * S * m
    heap = [(0.0, r) for r in range(R)]

    def ready_f(s: int) -> float:
        """Start time of F(s, next): exact once its input has arrived, else a lower bound."""
        j = nF[s]
        if s == 0:
            return 0.0
        d = fd[j]
        if d < 0:
            return _INF
        return endF[d][j] - tf[d] + A[s] - A[d] if d < s - 1 else endF[d][j] + cn[d]

    def ready_b(s: int) -> float:
        """Start time of B(s, next) (its F has run): exact once known, else a lower bound."""
        j = nB[s]
        if s == S - 1:
            return endF[s][j]
        b = bd[j]
        if b == s + 1:
            return max(endF[s][j], endB[b][j] + cn[s])
        if b < S:
            return endB[b][j] - tb[b] + G[s] - G[b]
        d = fd[j]
        return endF[d][j] - tf[d] + A[S - 1] - A[d] + tf[S - 1] + G[s]

    def pick(r: int, t: float):
        """(stage, op) to start at t, or (None, wake time) to wait (inf: wait for an event)."""
        best_b = None
        next_b = _INF  # earliest possible start of a B that other ranks wait for
        for s in stages[r]:
            j = nB[s]
            if j >= m or nF[s] <= j:
                continue
            rb = ready_b(s)
            if rb <= t and (bd[j] == s + 1 or s == S - 1):
                if best_b is None or (j, -s) < (nB[best_b], -best_b):
                    best_b = s
            elif s > 0 and rank_of[s - 1] != r:
                next_b = min(next_b, max(rb, t))
        if best_b is not None:
            return best_b, Op.B
        s0 = stages[r][0]
        best_f = None
        f_blocked = False
        next_f = _INF
        for s in stages[r]:
            j = nF[s]
            if j >= m or (s == s0 and j - nB[s0] >= cap[r]):
                continue
            if mem[r] + room[s] > limit[r]:
                f_blocked = True
                continue
            rf = ready_f(s)
            if rf > t or (s > 0 and fd[j] < s - 1):
                next_f = min(next_f, max(rf, t))
            elif best_f is None or (j, -s) < (nF[best_f], -best_f):
                best_f = s
        best_w = None
        pending_w = 0
        for s in stages[r]:
            pending_w += nB[s] - nW[s]
            if nW[s] < nB[s] and (best_w is None or nW[s] < nW[best_w]):
                best_w = s
        if best_w is not None and (f_blocked or pending_w > lag[r]):
            return best_w, Op.W
        if best_f is not None:
            wait = policy.wait_first if nB[s0] == 0 and nB[stages[r][-1]] == 0 else policy.wait_b
            if wait and t < next_b <= t + wait * tf[best_f]:
                return None, next_b
            return best_f, Op.F
        if best_w is not None:
            nxt = min(next_b, next_f)
            if policy.fit and t < nxt < t + tw[best_w]:
                return None, nxt
            return best_w, Op.W
        nxt = min(next_b, next_f)
        return None, nxt if nxt > t else _INF

    while remaining:
        if not heap:
            return None  # every rank waits for memory that only a blocked rank could free
        t, r = heapq.heappop(heap)
        if t < free[r]:
            continue
        s, op = pick(r, t)
        if s is None:
            if op < _INF:
                heapq.heappush(heap, (op, r))
            continue
        if op is Op.F:
            j = nF[s]
            end = endF[s][j] = t + tf[s]
            nF[s] += 1
            fd[j] = s
            mem[r] += mf[s]
            if s + 1 < S and rank_of[s + 1] != r:
                r2 = rank_of[s + 1]
                heapq.heappush(heap, (max(free[r2], end + cn[s]), r2))
        elif op is Op.B:
            j = nB[s]
            end = endB[s][j] = t + tb[s]
            nB[s] += 1
            bd[j] = s
            mem[r] += mb[s]
            if s > 0 and rank_of[s - 1] != r:
                r2 = rank_of[s - 1]
                heapq.heappush(heap, (max(free[r2], end + cn[s - 1]), r2))
        else:
            j = nW[s]
            end = t + tw[s]
            nW[s] += 1
            mem[r] += mw[s]
        rows[r].append(Action(s, op, j))
        first[r] = min(first[r], t)
        free[r] = end
        remaining -= 1
        heapq.heappush(heap, (end, r))
    if problem.objective == "span":
        return rows, max(f - s for f, s in zip(free, first))
    return rows, max(free)


def sequential_schedule(problem: Problem) -> list[list[Action]]:
    """One microbatch at a time through the whole pipeline: each rank runs, per microbatch, its
    forwards, then its B passes each followed at once by its W. Peak memory per rank is one
    microbatch's activations, the least any schedule needs."""
    c, m = problem.cost, problem.num_microbatches
    rows = []
    for r in range(c.num_ranks):
        st = sorted(c.rank_stages(r))
        row = []
        for j in range(m):
            row += [Action(s, Op.F, j) for s in st]
            for s in reversed(st):
                row += [Action(s, Op.B, j), Action(s, Op.W, j)]
        rows.append(row)
    return rows
