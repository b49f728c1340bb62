"""The simulator against an obviously correct slow one, on generated schedules.

The reference below re-reads the rules of the module docstring of ``zbsearch.simulator``
straight from ``dependencies.predecessors``: sweep the ranks round-robin, run a rank's next
action whenever every pass it needs has run, until no rank can move. The fast simulator (one
pass in dependency order over resolved tables) must give the same Timeline, float for float,
and the same errors: the same Deadlock waits, the same missing-dependency message.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import Action, Op
from zbsearch.classic import KINDS
from zbsearch.dependencies import predecessors
from zbsearch.errors import ZbError
from zbsearch.placement import placement
from zbsearch.simulator import Deadlock, simulate


def _needs(a: Action, S: int) -> list[tuple[int, Op, int]]:
    """Passes the action waits for: those of its basic passes, less the ones it performs."""
    own = [(a.stage, op, a.mb) for op in a.parts()]
    out: list[tuple[int, Op, int]] = []
    for op in a.parts():
        for dep in predecessors(a.stage, op, a.mb, S):
            if dep not in own and dep not in out:
                out.append(dep)
    return out


def reference(rows: list[list[Action]], cost: CostModel):
    """(start, end, memory, busy) by round-robin sweeps, or raises like the simulator."""
    S = cost.num_stages
    where = {}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            for op in a.parts():
                where.setdefault((a.stage, op, a.mb), (r, i))
    for r, row in enumerate(rows):
        for a in row:
            for dep in _needs(a, S):
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
                needed = [where[d] for d in _needs(a, S)]
                if any(end[q][i] is None for q, i in needed):
                    break
                t = end[r][nxt[r] - 1] if nxt[r] else 0.0
                for (q, i), d in zip(needed, _needs(a, S)):
                    t = max(t, end[q][i] + (cost.comm(d[0], a.stage) if d[0] != a.stage else 0.0))
                start[r][nxt[r]] = t
                end[r][nxt[r]] = t + cost.time(a.stage, a.op)
                nxt[r] += 1
                moved = True
    if any(n < len(row) for n, row in zip(nxt, rows)):
        waits = []
        for r, row in enumerate(rows):
            if nxt[r] < len(row):
                a = row[nxt[r]]
                q, i = next(where[d] for d in _needs(a, S) if end[where[d][0]][where[d][1]] is None)
                waits.append((r, a, rows[q][i], q))
        raise Deadlock(waits)
    memory = []
    for row in rows:
        cur, trace = 0.0, []
        for a in row:
            cur += cost.memory(a.stage, a.op)
            trace.append(cur)
        memory.append(trace)
    return start, end, memory, [sum(cost.time(a.stage, a.op) for a in row) for row in rows]


def _outcome(fn, rows, cost):
    try:
        tl = fn(rows, cost)
    except Deadlock as e:
        return ("deadlock", e.waits, str(e))
    except ZbError as e:
        return ("error", str(e))
    if isinstance(tl, tuple):
        return ("ok", *tl)
    return ("ok", tl.start, tl.end, tl.memory, tl.busy)


def _random_cost(rng: random.Random, p: int, chunks: int, layout: str) -> CostModel:
    """Costs with zero-time passes and zero delays now and then (set on the cost model: a
    profile refuses them), unequal BW, stages that keep no memory."""
    def t() -> float:
        return rng.choice([0.5, 1.0, round(rng.uniform(0.1, 3.0), 3)])

    stages = []
    for _ in range(p):
        m_f = rng.choice([0.0, 1.0, round(rng.uniform(0.2, 2), 3)])
        keep = rng.random()
        stages.append(StageCost(t_f=t(), t_b=t(), t_w=t(), t_bw=rng.choice([None, t()]), m_f=m_f,
                                m_b=-m_f * (1 - keep), m_w=-m_f * keep))
    prof = Profile(name="gen", memory_unit="activations", stages=stages,
                   t_comm=[rng.choice([0.0, 0.1, round(rng.uniform(0, 1), 3)]) for _ in range(p - 1)])
    cost = CostModel.from_profile(prof, placement(p, chunks, layout))

    def some_zero(xs: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(0.0 if rng.random() < 0.2 else x for x in xs)

    return replace(cost, t_f=some_zero(cost.t_f), t_b=some_zero(cost.t_b), t_w=some_zero(cost.t_w),
                   t_bw=some_zero(cost.t_bw))


def _random_order(rng: random.Random, cost: CostModel, m: int, fuse: float) -> list[list[Action]]:
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


def _mutate(rng: random.Random, rows: list[list[Action]]) -> list[list[Action]]:
    """Swaps within a rank (deadlocks, orders against a dependency), a dropped or repeated action."""
    rows = [list(r) for r in rows]
    for _ in range(rng.randint(1, 3)):
        r = rng.randrange(len(rows))
        row = rows[r]
        what = rng.random()
        if len(row) >= 2 and what < 0.7:
            i, k = sorted(rng.sample(range(len(row)), 2))
            row[i], row[k] = row[k], row[i]
        elif row and what < 0.85:
            row.pop(rng.randrange(len(row)))
        elif row:
            row.insert(rng.randrange(len(row) + 1), rng.choice(row))
    return rows


@st.composite
def _cases(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    p = draw(st.integers(1, 4))
    chunks, layout = draw(st.sampled_from([(1, "looped"), (2, "v"), (2, "looped")]))
    cost = _random_cost(rng, p, chunks, layout)
    rows = _random_order(rng, cost, draw(st.integers(1, 5)), fuse=draw(st.sampled_from([0.0, 0.3])))
    if draw(st.booleans()):
        rows = _mutate(rng, rows)
    return rows, cost


@given(_cases())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_same_as_reference(case):
    rows, cost = case
    assert _outcome(simulate, rows, cost) == _outcome(reference, rows, cost)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 7)])
def test_classic_orders_same_as_reference(kind, p, m):
    rng = random.Random(p * 100 + m)
    spec = KINDS[kind]
    cost = _random_cost(rng, p, spec.chunks, spec.layout)
    try:
        rows = spec.build(cost, m)
    except ZbError:  # e.g. interleaved needs m a multiple of p
        return
    out = _outcome(simulate, rows, cost)
    assert out[0] == "ok"
    assert out == _outcome(reference, rows, cost)


def test_deadlock_reports_each_stuck_rank():
    cost = _random_cost(random.Random(0), 2, 1, "looped")
    rows = [[Action(0, Op.F, 0), Action(0, Op.B, 0), Action(0, Op.W, 0)],
            [Action(1, Op.B, 0), Action(1, Op.F, 0), Action(1, Op.W, 0)]]
    with pytest.raises(Deadlock) as e:
        simulate(rows, cost)
    # rank 1 waits on itself (its B before its F); rank 0 waits for rank 1's B
    assert e.value.waits == [(0, Action(0, Op.B, 0), Action(1, Op.B, 0), 1), (1, Action(1, Op.B, 0), Action(1, Op.F, 0), 1)]
