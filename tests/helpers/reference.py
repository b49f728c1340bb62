"""Slow, obviously correct references for the simulator and the validator, and generators of
schedules (valid, and broken in the ways the validator names) to compare them on.

The references re-read the rules from ``dependencies.predecessors`` and the module docstrings
of ``zbsearch.simulator`` and ``zbsearch.validator``, without the tables the fast code resolves.
"""

from __future__ import annotations

import random
from dataclasses import replace

from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import Action, Op
from zbsearch.dependencies import predecessors
from zbsearch.errors import ZbError
from zbsearch.formats.schedule import Schedule
from zbsearch.layout import placement
from zbsearch.limits import fits
from zbsearch.simulator import Deadlock

__all__ = [
    "needs", "reference", "reference_duration", "reference_problem", "outcome", "random_profile", "random_cost",
    "random_order", "fuse_some", "mutate", "rank_orders",
]


def needs(a: Action, S: int) -> list[tuple[int, Op, int]]:
    """Passes the action waits for: those of its basic passes, less the ones it performs."""
    own = [(a.stage, op, a.mb) for op in a.parts()]
    out: list[tuple[int, Op, int]] = []
    for op in a.parts():
        for dep in predecessors(a.stage, op, a.mb, S):
            if dep not in own and dep not in out:
                out.append(dep)
    return out


def reference_duration(row: list[Action], a: Action, cost: CostModel) -> float:
    """What action ``a`` of a rank's ``row`` costs, read from the cost model's fields: the F of a
    microbatch whose backward the rank runs fused (a BW) takes t_ff, as the runtime runs it."""
    if a.op is Op.F:
        return cost.t_ff[a.stage] if Action(a.stage, Op.BW, a.mb) in row else cost.t_f[a.stage]
    return {Op.B: cost.t_b, Op.W: cost.t_w, Op.BW: cost.t_bw}[a.op][a.stage]


def positions(rows: list[list[Action]]) -> dict:
    """(stage, basic op, microbatch) -> (rank, index) of the first action that performs it."""
    where: dict = {}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for op in a.parts():
                where.setdefault((a.stage, op, a.mb), (r, i))
    return where


def reference(rows: list[list[Action]], cost: CostModel):
    """(start, end, memory, busy) by round-robin sweeps, or raises like the simulator."""
    S = cost.num_stages
    where = positions(rows)
    for r, row in enumerate(rows):
        for a in row:
            for dep in needs(a, S):
                if dep not in where:
                    raise ZbError(f"{a} on rank {r} depends on {dep[0]}{dep[1].value}{dep[2]}, which no rank executes")
    start = [[None] * len(row) for row in rows]
    end = [[None] * len(row) for row in rows]
    nxt = [0] * len(rows)
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(rows):
            while nxt[r] < len(row):
                a = row[nxt[r]]
                needed = [where[d] for d in needs(a, S)]
                if any(end[q][i] is None for q, i in needed):
                    break
                t = end[r][nxt[r] - 1] if nxt[r] else 0.0
                for (q, i), d in zip(needed, needs(a, S)):
                    t = max(t, end[q][i] + (cost.comm(d[0], a.stage) if d[0] != a.stage else 0.0))
                start[r][nxt[r]] = t
                end[r][nxt[r]] = t + reference_duration(row, a, cost)
                nxt[r] += 1
                moved = True
    if any(n < len(row) for n, row in zip(nxt, rows)):
        waits = []
        for r, row in enumerate(rows):
            if nxt[r] < len(row):
                a = row[nxt[r]]
                q, i = next(where[d] for d in needs(a, S) if end[where[d][0]][where[d][1]] is None)
                waits.append((r, a, rows[q][i], q))
        raise Deadlock(waits)
    memory = []
    for row in rows:
        cur, trace = 0.0, []
        for a in row:
            cur += cost.memory(a.stage, a.op)
            trace.append(cur)
        memory.append(trace)
    return start, end, memory, [sum(reference_duration(row, a, cost) for a in row) for row in rows]


def outcome(fn, rows, cost):
    try:
        tl = fn(rows, cost)
    except Deadlock as e:
        return ("deadlock", e.waits, str(e))
    except ZbError as e:
        return ("error", str(e))
    if isinstance(tl, tuple):
        return ("ok", *tl)
    return ("ok", tl.start, tl.end, tl.memory, tl.busy)


def random_profile(rng: random.Random, p: int) -> Profile:
    """Unequal stages, fused backwards that may be cheaper or dearer than B + W (and forwards
    before them than t_f), stages that keep no memory, links with and without delay."""
    def t() -> float:
        return rng.choice([0.5, 1.0, round(rng.uniform(0.1, 3.0), 3)])

    stages = []
    for _ in range(p):
        m_f = rng.choice([0.0, 1.0, round(rng.uniform(0.2, 2), 3)])
        keep = rng.random()
        t_f = t()
        stages.append(StageCost(t_f=t_f, t_b=t(), t_w=t(), t_bw=rng.choice([None, t()]), m_f=m_f,
                                m_b=-m_f * (1 - keep), m_w=-m_f * keep,
                                t_ff=rng.choice([None, round(t_f * rng.uniform(0.8, 1.1), 3) or t_f])))
    return Profile(name="gen", memory_unit="activations", stages=stages,
                   t_comm=[rng.choice([0.0, 0.1, round(rng.uniform(0, 1), 3)]) for _ in range(p - 1)])


def random_cost(rng: random.Random, p: int, chunks: int, layout: str) -> CostModel:
    """``random_profile``'s costs on the placement, with zero-time passes now and then (set on
    the cost model: a profile refuses them)."""
    cost = CostModel.from_profile(random_profile(rng, p), placement(p, chunks, layout))

    def some_zero(xs: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(0.0 if rng.random() < 0.2 else x for x in xs)

    return replace(cost, t_f=some_zero(cost.t_f), t_b=some_zero(cost.t_b), t_w=some_zero(cost.t_w),
                   t_bw=some_zero(cost.t_bw), t_ff=some_zero(cost.t_ff))


def random_order(rng: random.Random, cost: CostModel, m: int, fuse: float) -> list[list[Action]]:
    """A random executable schedule: passes taken in a random order among those whose inputs
    have run (a linear extension of the dependencies), some backwards fused into BW."""
    S = cost.num_stages
    done: set[tuple[int, Op, int]] = set()
    todo = {(s, op, j) for s in range(S) for op in (Op.F, Op.B, Op.W) for j in range(m)}
    rows: list[list[Action]] = [[] for _ in range(cost.num_ranks)]
    while todo:
        ready = sorted(x for x in todo if all(d in done for d in predecessors(*x, S)))
        s, op, j = rng.choice(ready)
        if op is Op.B and rng.random() < fuse:
            rows[cost.stage_to_rank[s]].append(Action(s, Op.BW, j))
            done |= {(s, Op.B, j), (s, Op.W, j)}
            todo -= {(s, Op.B, j), (s, Op.W, j)}
        else:
            rows[cost.stage_to_rank[s]].append(Action(s, op, j))
            done.add((s, op, j))
            todo.discard((s, op, j))
    return rows


def fuse_some(sched: Schedule, rng: random.Random) -> Schedule:
    """Fuse a random choice of B passes that their W follows at once on the same rank."""
    rows = []
    for row in sched.rank_actions:
        out, i = [], 0
        while i < len(row):
            a = row[i]
            nxt = row[i + 1] if i + 1 < len(row) else None
            if a.op is Op.B and nxt == Action(a.stage, Op.W, a.mb) and rng.random() < 0.6:
                out.append(Action(a.stage, Op.BW, a.mb))
                i += 2
            else:
                out.append(a)
                i += 1
        rows.append(out)
    return Schedule.build(sched.kind + "-fused", sched.profile, sched.num_microbatches, sched.stage_to_rank, rows)


def mutate(rng: random.Random, rows: list[list[Action]]) -> list[list[Action]]:
    """Swaps within a rank (orders against a dependency), a backward hoisted to just after its own
    forward (a wait across ranks, often a deadlock cycle), a dropped or repeated action."""
    rows = [list(r) for r in rows]
    for _ in range(rng.randint(1, 3)):
        r = rng.randrange(len(rows))
        row = rows[r]
        what = rng.random()
        backward = [k for k, a in enumerate(row) if a.op in (Op.B, Op.BW)]
        if backward and what < 0.35:
            k = rng.choice(backward)
            a = row.pop(k)
            f = next((i for i, x in enumerate(row) if (x.stage, x.op, x.mb) == (a.stage, Op.F, a.mb)), -1)
            row.insert(f + 1, a)
        elif len(row) >= 2 and what < 0.7:
            i, k = sorted(rng.sample(range(len(row)), 2))
            row[i], row[k] = row[k], row[i]
        elif row and what < 0.85:
            row.pop(rng.randrange(len(row)))
        elif row:
            row.insert(rng.randrange(len(row) + 1), rng.choice(row))
    return rows


def reference_problem(rows: list[list[Action]], stage_to_rank: list[int], m: int, cost: CostModel,
                      limit: list[float] | None, wait_cycle) -> str | None:
    """The validator's checks in the order its docstring gives, one rule at a time
    (``wait_cycle``: how the validator prints a deadlock's waits)."""
    S = len(stage_to_rank)
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if stage_to_rank[a.stage] != r:
                return f"{a} is on rank {r} (position {i}) but stage {a.stage} lives on rank {stage_to_rank[a.stage]}"
    first: dict = {}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for op in a.parts():
                key = (a.stage, op, a.mb)
                if key in first:
                    pr, pi = first[key]
                    return (f"{a.stage}{op.value}{a.mb} is done twice: {rows[pr][pi]} at rank {pr} position {pi} "
                            f"and {a} at rank {r} position {i}")
                first[key] = (r, i)
    for s in range(S):
        for j in range(m):
            for op in (Op.F, Op.B, Op.W):
                if (s, op, j) not in first:
                    return f"{s}{op.value}{j} is missing (rank {stage_to_rank[s]} never runs it)"
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for dep in needs(a, S):
                q, k = first[dep]
                if q == r and k > i:
                    return f"rank {r}: {a} at position {i} comes before {rows[q][k]} at position {k}, which it depends on"
    try:
        _, _, memory, _ = reference(rows, cost)
    except Deadlock as e:
        return "deadlock: " + wait_cycle(e.waits)
    if limit is not None:
        for r, row in enumerate(rows):
            for i, (a, cur) in enumerate(zip(row, memory[r])):
                if not fits(cur, limit[r]):
                    return f"rank {r}: memory reaches {cur:.6g} after {a} (position {i}), over its limit {limit[r]:.6g}"
    return None


def rank_orders(cost: CostModel, r: int, m: int, fifo: bool = False, ops: tuple[Op, ...] = (Op.F, Op.B, Op.W),
                fuse: bool = False) -> list[list[Action]]:
    """Every order of rank r's passes of ``ops`` that respects the dependencies among them (and,
    with ``fifo``, microbatch order per stage and kind); with ``fuse``, each B as a fused BW."""
    S = cost.num_stages
    mine = [(s, op, j) for s in cost.rank_stages(r) for op in ops for j in range(m)]
    need = {}
    for x in mine:
        deps, stack = set(), [x]
        while stack:
            for p in predecessors(*stack.pop(), S):
                if p not in deps:
                    deps.add(p)
                    stack.append(p)
        need[x] = {p for p in deps if cost.stage_to_rank[p[0]] == r}
        if fifo and x[2] > 0:
            need[x].add((x[0], x[1], x[2] - 1))
    out: list[list[Action]] = []

    def rec(done: set, seq: list) -> None:
        if len(seq) == len(mine):
            out.append([Action(s, Op.BW if fuse and op is Op.B else op, j) for s, op, j in seq])
            return
        for x in mine:
            if x not in done and need[x] <= done:
                done.add(x)
                seq.append(x)
                rec(done, seq)
                seq.pop()
                done.remove(x)

    rec(set(), [])
    return out
