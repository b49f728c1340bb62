"""MILP improvement: re-optimise one time window of the schedule at a time (PuLP + HiGHS).

The paper's model has a big-M order binary for every pair of passes on a stage and stalls
beyond p=8, m=16. This one scales because it only ever models a *window*: on each rank the
passes that start in [t1, t2) in the current schedule, a contiguous part of the rank's list.

* Passes before the window keep their times: every pass they depend on starts earlier, so it
  is before the window too, and the window cannot change them.
* Passes after the window keep their order and run as soon as they can. Their finish times
  are max-plus linear in the window's end times, so the objective is exactly
  ``max(C, max_x E_x + tail(x))`` over window passes x, with tails and C from one pass over the
  rest of the schedule (``_tails``). No variable is spent on them.
* Inside the window, passes of one (stage, op) keep microbatch order (FIFO loses nothing,
  see ``problem``). Two passes of different chains get an order binary only when neither a
  dependency nor their distance in the current schedule (more than ``band``) fixes their
  order, and a pass is linked only to the nearest fixed pass of each other chain: the chain
  order implies the rest.
* Memory is exact: memory after a pass is the memory before the window plus the deltas of
  the window passes before it, linear in the order binaries; only passes that allocate need
  the constraint.
* Big-M constants come from each pass's earliest start and latest end that still beats the
  current objective, so they are tight.

The current schedule is the warm start (HiGHS gets it as a full solution), so a window never
returns anything worse, and the result is re-simulated before it is accepted. With the
window covering the whole schedule and no band, the model is exact and HiGHS's dual bound is
a lower bound for every schedule (``exact``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import highspy
import pulp

from ..actions import Action, Op
from ..dependencies import action_index, edge_delay, must_precede, predecessors
from ..simulator import Timeline
from .problem import Problem

__all__ = ["WindowResult", "ImproveStats", "solve_window", "improve", "exact"]

_NEG = float("-inf")
_INF = float("inf")


_FEASIBILITY_TOL = 1e-10


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface plus a full warm-start solution and the MIP dual bound."""

    def __init__(self, start: dict[str, float], **kw):
        super().__init__(**kw)
        self.start = start
        self.dual_bound = _NEG
        self.model_status = None

    def callSolver(self, lp):
        h = lp.solverModel
        sol = highspy.HighsSolution()
        sol.col_value = [self.start.get(v.name, 0.0) for v in lp.variables()]
        sol.value_valid = True
        h.setSolution(sol)
        # HiGHS accepts rows violated by up to 1e-7 by default; memory deltas can be that small,
        # so a tolerated violation would be a real overflow the validator rejects.
        for option in ("primal_feasibility_tolerance", "mip_feasibility_tolerance"):
            h.setOptionValue(option, _FEASIBILITY_TOL)
        h.run()
        self.model_status = h.getModelStatus()
        info = h.getInfo()
        self.dual_bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else _NEG


@dataclass
class WindowResult:
    rows: list[list[Action]]
    model_value: float  # objective of the model's solution (an upper bound on the simulated one)
    dual_bound: float  # HiGHS's bound on this window's objective
    optimal: bool
    binaries: int


def _tails(problem: Problem, rows, tl: Timeline, a: list[int], b: list[int], index):
    """(T, C): T[(r, i)] = longest path from the end of window pass (r, i) to the objective
    through the passes after the window, C = the part of the objective no window pass reaches."""
    c, S = problem.cost, problem.cost.num_stages
    off = problem.rank_start if problem.objective == "span" else [0.0] * len(rows)
    suffix = sorted((tl.start[r][i], r, i) for r in range(len(rows)) for i in range(b[r], len(rows[r])))

    def preds(r, i):
        x = rows[r][i]
        for st, op, j in predecessors(x.stage, x.op, x.mb, S):
            pr, pi = index[(st, op, j)]
            yield pr, pi, edge_delay(c, st, x.stage)

    # Backward: val[(r, i)] = longest path from the end of pass (r, i) to the objective.
    T = {(r, i): (-off[r] if b[r] == len(rows[r]) else _NEG) for r in range(len(rows)) for i in range(a[r], b[r])}
    val: dict = {}
    for _, r, i in reversed(suffix):
        v = val.get((r, i), _NEG)
        if i == len(rows[r]) - 1:
            v = max(v, -off[r])
        if v == _NEG:
            continue
        x = rows[r][i]
        w = v + c.time(x.stage, x.op)  # from the end of a predecessor, before delays
        if i > b[r]:
            val[(r, i - 1)] = max(val.get((r, i - 1), _NEG), w)
        else:  # the first pass after the window follows every window pass of its rank
            for k in range(a[r], b[r]):
                T[(r, k)] = max(T[(r, k)], w)
        for pr, pi, delay in preds(r, i):
            if pi >= b[pr]:
                val[(pr, pi)] = max(val.get((pr, pi), _NEG), w + delay)
            elif pi >= a[pr]:
                T[(pr, pi)] = max(T[(pr, pi)], w + delay)
    # Forward: end times of passes after the window as far as earlier passes alone drive them.
    C = max((tl.end[r][-1] - off[r] for r, row in enumerate(rows) if row and a[r] == len(row)), default=_NEG)
    base: dict = {}
    for _, r, i in suffix:
        x = rows[r][i]
        if i > b[r]:
            t = base[(r, i - 1)]
        elif a[r] == b[r]:
            t = tl.end[r][i - 1] if i > 0 else 0.0
        else:
            t = _NEG
        for pr, pi, delay in preds(r, i):
            if pi < a[pr]:
                t = max(t, tl.end[pr][pi] + delay)
            elif pi >= b[pr]:
                t = max(t, base[(pr, pi)] + delay)
        base[(r, i)] = t + c.time(x.stage, x.op) if t > _NEG else _NEG
        if i == len(rows[r]) - 1:
            C = max(C, base[(r, i)] - off[r])
    return T, C


def solve_window(
    problem: Problem,
    rows: list[list[Action]],
    tl: Timeline,
    t1: float,
    t2: float,
    band: float,
    time_limit: float,
    secondary: bool = True,
) -> WindowResult | None:
    """Re-optimise the passes that start in [t1, t2); None if the window is empty."""
    c, S = problem.cost, problem.cost.num_stages
    R = len(rows)
    limits = problem.allowed()
    a = [next((i for i, s in enumerate(tl.start[r]) if s >= t1), len(rows[r])) for r in range(R)]
    b = [next((i for i, s in enumerate(tl.start[r]) if s >= t2), len(rows[r])) for r in range(R)]
    b = [max(x, y) for x, y in zip(a, b)]
    win = [(r, i) for r in range(R) for i in range(a[r], b[r])]
    if not win:
        return None
    index = action_index(rows)
    T, C = _tails(problem, rows, tl, a, b, index)
    value = problem.value(tl)

    def dur(r, i):
        x = rows[r][i]
        return c.time(x.stage, x.op)

    # Earliest starts (prefix constants + precedence inside the window) and latest ends.
    order = sorted(win, key=lambda k: (tl.start[k[0]][k[1]], k))
    lb, ub = {}, {}
    for r, i in order:
        x = rows[r][i]
        t = tl.end[r][a[r] - 1] if a[r] > 0 else 0.0
        for st, op, j in predecessors(x.stage, x.op, x.mb, S):
            pr, pi = index[(st, op, j)]
            delay = edge_delay(c, st, x.stage)
            t = max(t, (tl.end[pr][pi] if pi < a[pr] else lb[(pr, pi)] + dur(pr, pi)) + delay)
        lb[(r, i)] = t
    slack = 1e-7 * max(1.0, value)  # float noise between the simulator's sums and ours
    for k in win:
        ub[k] = value + slack - T[k] if T[k] > _NEG else value + max(problem.rank_start) + 1.0
    succ_in_win: dict = {}
    for r, i in win:
        x = rows[r][i]
        for st, op, j in predecessors(x.stage, x.op, x.mb, S):
            pk = index[(st, op, j)]
            if pk in ub:
                delay = edge_delay(c, st, x.stage)
                succ_in_win.setdefault(pk, []).append(((r, i), delay))
    for k in reversed(order):
        for sk, delay in succ_in_win.get(k, ()):
            ub[k] = min(ub[k], ub[sk] - dur(*sk) - delay)
    if any(lb[k] + dur(*k) > ub[k] + 1e-6 for k in win):
        return None  # cannot happen for a consistent timeline; be safe rather than wrong

    lp = pulp.LpProblem("window", pulp.LpMinimize)
    name = {k: f"s{k[0]}_{k[1]}" for k in win}
    S_ = {k: lp.add_variable(name[k], lb[k], ub[k] - dur(*k)) for k in win}
    z = lp.add_variable("z", C if C > _NEG else None, value + slack)
    start = {name[k]: tl.start[k[0]][k[1]] for k in win}
    start["z"] = value
    eps = 1e-6 / len(win) if secondary else 0.0
    lp += z + eps * pulp.lpSum(S_.values())

    for k in win:
        r, i = k
        x = rows[r][i]
        for st, op, j in predecessors(x.stage, x.op, x.mb, S):
            pk = index[(st, op, j)]
            if pk in S_:
                delay = edge_delay(c, st, x.stage)
                lp += S_[k] >= S_[pk] + dur(*pk) + delay
        if T[k] > _NEG:
            lp += z >= S_[k] + dur(*k) + T[k]

    nbin = 0
    mem_terms_of, preceding = [], {}
    for r in range(R):
        chains: dict[tuple[int, Op], list[int]] = {}
        for i in range(a[r], b[r]):
            x = rows[r][i]
            chains.setdefault((x.stage, x.op), []).append(i)
        for ids in chains.values():
            preceding.update(((r, i), pos) for pos, i in enumerate(ids))
            for i0, i1 in zip(ids, ids[1:]):
                lp += S_[(r, i1)] >= S_[(r, i0)] + dur(r, i0)
        # mem_terms[i]: (k, 1 or binary) for each pass k of another chain that may precede i
        mem_terms: dict[int, list] = {i: [] for i in range(a[r], b[r])}
        mem_terms_of.append(mem_terms)
        keys = list(chains)
        for ci, X in enumerate(keys):
            for Y in keys[ci + 1:]:
                for i in chains[X]:
                    xi = rows[r][i]
                    last_before = first_after = None
                    for k in chains[Y]:
                        yk = rows[r][k]
                        if (xi.mb <= yk.mb and must_precede(X, Y, S)) or tl.start[r][k] - tl.start[r][i] > band:
                            first_after = k if first_after is None else first_after
                            mem_terms[k].append((i, 1))
                        elif (yk.mb <= xi.mb and must_precede(Y, X, S)) or tl.start[r][i] - tl.start[r][k] > band:
                            last_before = k
                            mem_terms[i].append((k, 1))
                        elif lb[(r, k)] + dur(r, k) > ub[(r, i)] - dur(r, i) + 1e-9:
                            # y cannot end before x must start: y's order is forced after x
                            lp += S_[(r, k)] >= S_[(r, i)] + dur(r, i)
                            mem_terms[k].append((i, 1))
                        elif lb[(r, i)] + dur(r, i) > ub[(r, k)] - dur(r, k) + 1e-9:
                            lp += S_[(r, i)] >= S_[(r, k)] + dur(r, k)
                            mem_terms[i].append((k, 1))
                        else:
                            v = lp.add_variable(f"o{r}_{i}_{k}", 0, 1, pulp.LpBinary)  # 1: i before k
                            start[v.name] = 1.0 if (tl.start[r][i], i) < (tl.start[r][k], k) else 0.0
                            nbin += 1
                            m1 = ub[(r, i)] - lb[(r, k)]
                            m2 = ub[(r, k)] - lb[(r, i)]
                            lp += S_[(r, k)] >= S_[(r, i)] + dur(r, i) - m1 * (1 - v)
                            lp += S_[(r, i)] >= S_[(r, k)] + dur(r, k) - m2 * v
                            mem_terms[k].append((i, v))
                            mem_terms[i].append((k, 1 - v))
                    if last_before is not None:
                        lp += S_[(r, i)] >= S_[(r, last_before)] + dur(r, last_before)
                    if first_after is not None:
                        lp += S_[(r, first_after)] >= S_[(r, i)] + dur(r, i)
        # Memory after each allocating pass: memory before the window + deltas of what precedes.
        m0 = tl.memory[r][a[r] - 1] if a[r] > 0 else 0.0
        for ids in chains.values() if math.isfinite(limits[r]) else ():
            for pos, i in enumerate(ids):
                x = rows[r][i]
                d = c.memory(x.stage, x.op)
                if d <= 0:
                    continue
                own = sum(c.memory(rows[r][k].stage, rows[r][k].op) for k in ids[:pos])
                expr = pulp.lpSum(c.memory(rows[r][k].stage, rows[r][k].op) * w for k, w in mem_terms[i])
                lp += expr + (m0 + own + d) <= limits[r]

    solver = _HiGHS(start, msg=False, timeLimit=max(0.1, time_limit), threads=os.cpu_count() or 1,
                    gapRel=1e-6 if not secondary else 1e-5)
    lp.solve(solver)
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    # New order per rank: a pass's position is the number of window passes before it, read
    # from the order terms (exact even for passes of zero length, unlike start times).
    new_rows = [list(row) for row in rows]
    for r in range(R):
        pos = {i: preceding[(r, i)] + sum(round(pulp.value(w)) if not isinstance(w, int) else w for _, w in mem_terms_of[r][i])
               for i in range(a[r], b[r])}
        new_rows[r][a[r]:b[r]] = [rows[r][i] for i in sorted(pos, key=pos.get)]
    optimal = solver.model_status == highspy.HighsModelStatus.kOptimal
    bound = solver.dual_bound - (eps * sum(ub[k] for k in win) if eps else 0.0)
    return WindowResult(new_rows, pulp.value(z), bound, optimal, nbin)


def exact(problem: Problem, rows: list[list[Action]], time_limit: float) -> WindowResult | None:
    """The whole schedule as one window, with no band: an exact model of the problem."""
    _, tl = problem.evaluate(rows)
    return solve_window(problem, rows, tl, 0.0, _INF, _INF, time_limit, secondary=False)


@dataclass
class ImproveStats:
    windows: int = 0
    improved: int = 0
    binaries: int = 0
    converged: bool = False  # a sweep with windows as long as the schedule found nothing more


def improve(
    problem: Problem,
    rows: list[list[Action]],
    deadline: float,
    on_step=None,
    target: float = _NEG,
) -> tuple[list[list[Action]], ImproveStats]:
    """Large-neighbourhood search: sweep windows over the schedule until ``deadline``
    (time.monotonic()), keeping each re-optimised window that the simulator confirms is
    better. Windows grow after a sweep without improvement; a window that hits its time
    limit makes the next ones smaller. Stops as soon as the objective reaches ``target``
    (a lower bound: nothing better exists)."""
    c = problem.cost
    tick = time.monotonic()
    value, tl = problem.evaluate(rows)
    # Each window also costs a pass over the schedule to build and one to simulate: keep
    # time for them so the deadline holds at p=32, m=256 too.
    overhead = 3 * (time.monotonic() - tick) + 0.05
    score = (value, sum(tl.span))
    unit = max(c.t_f[s] + c.t_b[s] + c.t_w[s] for s in range(c.num_stages)) * (c.num_stages // c.num_ranks)
    length = 2.0 * unit
    stats = ImproveStats()

    def time_left() -> bool:
        return time.monotonic() < deadline - 2 * overhead and score[0] > target

    while time_left():
        horizon = max(e[-1] for e in tl.end if e)
        step = length / 2
        swept_better = False
        t1 = 0.0
        while t1 < horizon and time_left():
            left = deadline - time.monotonic() - overhead
            res = solve_window(problem, rows, tl, t1, t1 + length, length, min(left, 2.0 + length / unit))
            stats.windows += 1
            if res is not None:
                stats.binaries = max(stats.binaries, res.binaries)
                v2, tl2 = problem.evaluate(res.rows)
                new = (v2, sum(tl2.span))
                better = new[0] < score[0] * (1 - 1e-9) or (new[0] <= score[0] and new[1] < score[1] * (1 - 1e-9))
                if better and problem.fits(tl2):
                    rows, tl, score = res.rows, tl2, new
                    stats.improved += 1
                    swept_better = True
                    horizon = max(e[-1] for e in tl.end if e)
                if not res.optimal:
                    length = max(unit, length / 1.5)
            if on_step is not None:
                on_step(score[0], stats)
            t1 += step
        if t1 < horizon or score[0] <= target:
            break  # out of time mid-sweep, or optimal
        if not swept_better:
            if length >= horizon:
                stats.converged = True
                break
            length *= 1.5
    if score[0] <= target:
        stats.converged = True  # optimal: the target is a lower bound
    return rows, stats
