"""Greedy list scheduler: simulate the pipeline and, whenever a rank is idle, start the best
ready pass by a priority rule, under a per-rank memory limit.

This is how schedules are *constructed* when no closed rule exists (ZB-V) and the seed of the
solver. Rules: a ready B always may run (it is on the critical path and frees memory); an F
may run only if its activations fit under the limit; a W runs when nothing more urgent is
ready, or when memory blocks every ready F (W frees memory). Among passes of one kind the
priority function decides. Costs are the real per-stage costs, not an average.

With several stages per rank, an F must leave room for one F on each of the rank's later
stages. Otherwise a rank can fill up with first-chunk forwards and never start the
second-chunk forward that the first backward is waiting for (a deadlock). With the room kept,
the oldest microbatch can always finish its forwards, its backward then frees memory, and the
pipeline keeps moving.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from .actions import Action, Op
from .costs import CostModel
from .errors import ZbError
from .graph import pass_predecessors

__all__ = ["greedy_schedule", "Priority"]

# key(action, ready_time) -> sortable; smallest first among passes of one kind on one rank
Priority = Callable[[Action, float], tuple]

_EPS = 1e-9


def _default_priority(a: Action, ready: float) -> tuple:
    # Earliest microbatch first, then the deeper stage (closer to the loss) first.
    return (a.mb, -a.stage)


def greedy_schedule(
    cost: CostModel,
    num_microbatches: int,
    memory_limit: list[float] | None = None,
    priority: Priority = _default_priority,
    w_first_when_idle: bool = True,
) -> list[list[Action]]:
    S, R, m = cost.num_stages, cost.num_ranks, num_microbatches
    limit = memory_limit or [float("inf")] * R
    for r in range(R):
        need = sum(cost.m_f[s] for s in cost.rank_stages(r))
        if need > limit[r] + _EPS:
            raise ZbError(f"memory limit {limit[r]:g} on rank {r} is below one microbatch's activations ({need:g})")

    end: dict[tuple[int, Op, int], float] = {}
    waiting: dict[tuple[int, Op, int], int] = {}  # unfinished predecessor count
    ready_at: dict[tuple[int, Op, int], float] = {}
    succ: dict[tuple[int, Op, int], list[tuple[int, Op, int]]] = {}
    for s in range(S):
        for op in (Op.F, Op.B, Op.W):
            for j in range(m):
                deps = pass_predecessors(s, op, j, S)
                waiting[(s, op, j)] = len(deps)
                for d in deps:
                    succ.setdefault(d, []).append((s, op, j))
                if not deps:
                    ready_at[(s, op, j)] = 0.0
    candidates: list[dict[Op, set]] = [{Op.F: set(), Op.B: set(), Op.W: set()} for _ in range(R)]
    for key in ready_at:
        candidates[cost.stage_to_rank[key[0]]][key[1]].add(key)

    free = [0.0] * R
    mem = [0.0] * R
    # F on stage s needs room for itself and one F on each later stage of its rank
    room = [sum(cost.m_f[t] for t in cost.rank_stages(cost.stage_to_rank[s]) if t >= s) for s in range(S)]
    rows: list[list[Action]] = [[] for _ in range(R)]
    remaining = 3 * S * m
    clock = 0.0
    while remaining:
        started = False
        for r in range(R):
            if free[r] > clock + _EPS:
                continue
            pick = _choose(r, clock, candidates[r], ready_at, mem[r], limit[r], room, priority, w_first_when_idle)
            if pick is None:
                continue
            s, op, j = pick
            candidates[r][op].discard(pick)
            t0 = max(clock, free[r])
            free[r] = end[pick] = t0 + cost.time(s, op)
            mem[r] += cost.memory(s, op)
            rows[r].append(Action(s, op, j))
            remaining -= 1
            started = True
            for nxt in succ.get(pick, ()):
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready_at[nxt] = max(
                        end[d] + (cost.comm(d[0], nxt[0]) if d[0] != nxt[0] else 0.0)
                        for d in pass_predecessors(*nxt, S)
                    )
                    candidates[cost.stage_to_rank[nxt[0]]][nxt[1]].add(nxt)
        if started:
            continue
        # Nothing can start now: move the clock to the next moment something may change.
        nxt_times = [f for f in free if f > clock + _EPS]
        nxt_times += [ready_at[k] for c in candidates for kind in c.values() for k in kind if ready_at[k] > clock + _EPS]
        if not nxt_times:
            raise ZbError("memory limit too small: every rank is blocked waiting for memory")
        clock = min(nxt_times)
    return rows


def _choose(r, clock, cands, ready_at, mem, limit, room, priority, w_first_when_idle):
    def ready(kind):
        return [k for k in cands[kind] if ready_at[k] <= clock + _EPS]

    def best(keys):
        return min(keys, key=lambda k: priority(Action(k[0], k[1], k[2]), ready_at[k]))

    bs = ready(Op.B)
    if bs:
        return best(bs)
    fs = [k for k in ready(Op.F) if mem + room[k[0]] <= limit + _EPS]
    ws = ready(Op.W)
    if fs:
        return best(fs)
    if ws and (w_first_when_idle or ready(Op.F)):
        return min(ws, key=lambda k: (k[2], k[0]))
    return None
