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
* Inside the window, passes of one chain (a stage's forwards, its backwards, B or fused BW,
  or its W passes) keep their order (FIFO in the exact model, which loses nothing in the idle
  relaxation, see ``problem``). Two passes of different chains get an order binary only when neither a
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
window covering the whole schedule and no band, each rank's span measured from its first pass
(a variable), the model is the exact idle relaxation and HiGHS's dual bound, less a margin for
its tolerances, is a lower bound for every schedule (``exact``). Windows keep each backward
fused or split as it is; the exact model chooses, where fusing may pay (``_ChoiceModel``).
Where sharded stages gather their parameters (``zbsearch.reductions``), each stage's first pass
on its rank starts after its gather, and for the iteration each rank counts from its step's
start: in the exact relaxed model a variable at most each stage's first pass less the end of its
gather, so the dual bound is one on the iteration with the gathers; elsewhere the step's start is
priced from the earliest the later stages' first passes can start, so a model never promises
less than the simulator gives. The model prices passes and lanes at full speed: without the
reductions' slowdown of the passes beside them (``CostModel.slowdown``), the passes' of the
reductions (``CostModel.stretch``) and the lanes' sharing of links. Each only lengthens
(``zbsearch.reductions``), so the dual bound stays a bound, and the re-simulation prices them.

Windows keep each microbatch's recomputation as it is too (a recompute pass orders against the
others like any pass, before its backward by ``dependencies.must_precede``); the exact model has
no recompute choice, so where the costs offer recomputation it is no bound (``exact`` refuses).

Overlapped pairs. Where the passes hold all-to-all (``CostModel.has_all_to_all``) a binary y
says whether a forward and a backward (B or BW) of another microbatch on one rank run as one
pair, for each such two passes of the window that no dependency or band orders and that would
save time (a pair that hides nothing is no better than its passes in turn); a pass has at most
one partner. Paired, the two start together and both end at the start plus
``CostModel.pair_time`` (a pass's duration is affine in its y's), the order rows between them
are lifted and the forward comes first in the order, so that memory counts as the simulator
counts it. A window keeps the pairs outside it: those after it enter the tails as one pass each
(``_paired_after``). Where fusing or recomputation is a choice (the exact model), a pass that
may pair has a duration variable tied to its choices and its pair's (``_ChoiceModel``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import highspy
import pulp

from .. import clock
from .._highs import stdout_muted
from ..actions import RECOMPUTES, Action, Op
from ..costs import CostModel, Recompute
from ..dependencies import PassType, action_index, action_predecessor_types, edge_delay, must_precede
from ..reductions import gather_ends, gather_releases, lane_runs, last_backward
from ..simulator import Deadlock, Timeline
from ..tolerances import EPS_MS, REL_TOL
from .heuristic import sequential_schedule
from .problem import Problem

__all__ = ["WindowResult", "ImproveStats", "solve_window", "improve", "improve_paired", "exact"]

_NEG = float("-inf")
_INF = float("inf")


# Margin taken off HiGHS's dual bound before it is trusted: HiGHS works to tolerances (1e-7
# on rows, 1e-6 relative gap), not exactly.
_DUAL_MARGIN = 1e-6


def _variable(lp: pulp.LpProblem, name: str, low: float | None, up: float | None, cat: str = pulp.LpContinuous):
    """A new variable of ``lp``: PuLP 3.3 and later make it through the problem (and deprecate
    free-standing variables), earlier releases only know free-standing ``LpVariable``."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, low, up, cat)
    return pulp.LpVariable(name, low, up, cat)


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface plus a full warm-start solution and the MIP dual bound."""

    def __init__(self, start: dict[str, float], seconds: float, **kw):
        super().__init__(**kw)
        self.start = start
        self.seconds = seconds  # on the clock (``zbsearch.clock``): seconds, or work
        self.dual_bound = _NEG
        self.model_status = None

    def createAndConfigureSolver(self, lp):
        # HiGHS prints its banner to the process's stdout when a model is created, before any
        # option can silence it; a library call and `solve -o -` must keep stdout their own
        with stdout_muted():
            super().createAndConfigureSolver(lp)

    def callSolver(self, lp):
        h = lp.solverModel
        sol = highspy.HighsSolution()
        sol.col_value = [self.start.get(v.name, 0.0) for v in lp.variables()]
        sol.value_valid = True
        h.setSolution(sol)
        nonzeros = h.getNumNz()
        seconds, most = clock.highs_limits(self.seconds, nonzeros)
        h.setOptionValue("time_limit", seconds)
        looks = 0

        def look(event) -> None:  # (on the work clock: HiGHS's looks at whether to stop count its work)
            nonlocal looks
            looks += 1
            if most is not None and looks >= most:
                event.interrupt()

        if most is not None:
            h.cbMipInterrupt += look
        # HiGHS's default tolerances: tighter ones (1e-10) cut off feasible points on big-M rows
        # and gave false optima. A tolerated memory overflow is caught where every result is
        # re-simulated and checked against the limit.
        h.run()
        self.model_status = h.getModelStatus()
        info = h.getInfo()
        clock.highs_spent(looks, 0 if lp.isMIP() else info.simplex_iteration_count, nonzeros)
        # (a model without binaries is an LP: HiGHS reports no MIP bound, its optimum is the bound)
        lp_optimum = not lp.isMIP() and self.model_status == highspy.HighsModelStatus.kOptimal
        bound = info.objective_function_value if lp_optimum else info.mip_dual_bound
        self.dual_bound = bound - _DUAL_MARGIN * max(1.0, abs(bound)) if math.isfinite(bound) else _NEG


    def findSolutionValues(self, lp):
        try:
            return super().findSolutionValues(lp)
        except KeyError:  # a status PuLP does not know: HiGHS stopped at the work clock's node limit
            if not math.isfinite(lp.solverModel.getInfo().objective_function_value):
                return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible  # as PuLP reads a time limit


@dataclass
class WindowResult:
    """One window's MILP solution: the new rows, the model's objective and bound, and its size."""
    rows: list[list[Action]]
    model_value: float  # objective of the model's solution (an upper bound on the simulated one)
    dual_bound: float  # HiGHS's bound on this window's objective
    optimal: bool
    binaries: int
    pairs: list[list[int]] | None = None  # the new rows' overlapped pairs (``Schedule.overlapped``; None: none)


Key = tuple[int, int]  # a pass by (rank, position in the rank's list)


def _inputs(problem: Problem, rows: list[list[Action]], index, r: int, i: int):
    """(rank, position, edge delay) of each action that action (r, i) depends on (a fused BW
    performs its B and its W: ``index`` maps both to it)."""
    x, c = rows[r][i], problem.cost
    for st, op in action_predecessor_types(x.stage, x.op, c.num_stages):
        pr, pi = index[(st, op, x.mb)]
        yield pr, pi, edge_delay(c, st, x.stage)


def _chain(x: Action) -> PassType:
    """The chain an action belongs to: its stage's forwards, its backwards (B or a fused BW:
    either one runs first of the microbatch's backward work, so they share one order) or its
    W passes; named by the pass type that all the chain's precedences go through."""
    return (x.stage, Op.B if x.op is Op.BW else x.op)


def _tails(problem: Problem, rows, tl: Timeline, begin: list[int], stop: list[int], index, off: list[float | None],
           dur: list[list[float]], steps: list[float], marks: dict | None = None, release: dict | None = None):
    """(tail, rest) of the objective through the passes after the window.

    The objective is the largest (end of a rank's last pass + ``steps[r]`` - that rank's start
    ``off[r]``); ``steps[r]`` is what follows the rank's last pass in every schedule (its
    optimizer steps, for the iteration; else 0); ``off[r]`` is a constant (0 for makespan, the
    fixed start of a rank whose first pass is not in the window) or None when it is a variable
    of the window (the start of the rank's first pass). Paths are grouped by label: None for
    ranks with a constant start (already subtracted), r for the rank r with a variable start,
    and each label of ``marks`` (label -> (rank, position) of a pass after the window) for the
    end of that pass (a stage's last backward, which its reduction waits for). tail[(r, i)][label]
    = longest path from the end of window pass (r, i) to that label's objective; rest[label] =
    the part no window pass reaches. ``dur``: what each pass costs (``CostModel.durations``)."""
    R = len(rows)
    suffix = sorted((tl.start[r][i], r, i) for r in range(R) for i in range(stop[r], len(rows[r])))
    labels: list = [None] + [r for r in range(R) if off[r] is None]
    # per pass, the objectives its end reaches at once: label -> what is added
    sinks: dict[Key, dict] = {}
    for r, row in enumerate(rows):
        if row:
            start = off[r]
            ends = sinks.setdefault((r, len(row) - 1), {})
            if start is not None:
                ends[None] = steps[r] - start
            else:
                ends[r] = steps[r]
    for label, at in (marks or {}).items():
        labels.append(label)
        sinks.setdefault(at, {})[label] = 0.0
    nothing: dict = {}

    tail: dict = {(r, i): {} for r in range(R) for i in range(begin[r], stop[r])}
    for label in labels:
        # Backward: val[(r, i)] = longest path from the end of pass (r, i) to the objective.
        lt = {(r, i): (sinks.get((r, len(rows[r]) - 1), nothing).get(label, _NEG) if stop[r] == len(rows[r]) else _NEG)
              for r in range(R) for i in range(begin[r], stop[r])}
        val: dict = {}
        for _, r, i in reversed(suffix):
            v = max(val.get((r, i), _NEG), sinks.get((r, i), nothing).get(label, _NEG))
            if v == _NEG:
                continue
            w = v + dur[r][i]  # from the end of a predecessor, before delays
            if i > stop[r]:
                val[(r, i - 1)] = max(val.get((r, i - 1), _NEG), w)
            else:  # the first pass after the window follows every window pass of its rank
                for k in range(begin[r], stop[r]):
                    lt[(r, k)] = max(lt[(r, k)], w)
            for pr, pi, delay in _inputs(problem, rows, index, r, i):
                if pi >= stop[pr]:
                    val[(pr, pi)] = max(val.get((pr, pi), _NEG), w + delay)
                elif pi >= begin[pr]:
                    lt[(pr, pi)] = max(lt[(pr, pi)], w + delay)
        for key, v in lt.items():
            if v > _NEG:
                tail[key][label] = v
    # Forward: end times of passes after the window as far as earlier passes alone drive them.
    ended = [r for r, row in enumerate(rows) if row and begin[r] == len(row)]  # ranks wholly before the window
    rest = {label: _NEG for label in labels}
    for r in ended:
        for label, add in sinks[(r, len(rows[r]) - 1)].items():
            rest[label] = max(rest[label], tl.end[r][-1] + add)
    base: dict = {}
    for _, r, i in suffix:
        if i > stop[r]:
            t = base[(r, i - 1)]
        elif begin[r] == stop[r]:
            t = tl.end[r][i - 1] if i > 0 else 0.0
        else:
            t = _NEG
        for pr, pi, delay in _inputs(problem, rows, index, r, i):
            if pi < begin[pr]:
                t = max(t, tl.end[pr][pi] + delay)
            elif pi >= stop[pr]:
                t = max(t, base[(pr, pi)] + delay)
        if release:  # a stage's first pass waits for its gather
            t = max(t, release.get((r, i), _NEG))
        base[(r, i)] = t + dur[r][i] if t > _NEG else _NEG
        for label, add in sinks.get((r, i), nothing).items():
            rest[label] = max(rest[label], base[(r, i)] + add)
    return tail, rest


def _paired_after(cost: CostModel, rows: list[list[Action]], stop: list[int], index, dur: list[list[float]],
                  pairs: list[list[int]]):
    """(index, durations) for ``_tails`` where overlapped pairs start after the window: each such
    pair's forward takes no time and its backward the pair's (``pair_time``), and what needs
    the forward waits for the backward's end. The pair then starts when its rank is free and
    both passes' inputs are there, and both end together, as the simulator runs it."""
    after = [(r, i) for r, at in enumerate(pairs) for i in at if i >= stop[r]]
    if not after:
        return index, dur
    index, dur = dict(index), [list(d) for d in dur]
    for r, i in after:
        f, b = rows[r][i], rows[r][i + 1]
        t = cost.pair_time(f, b, dur[r][i], dur[r][i + 1])
        index[(f.stage, f.op, f.mb)] = (r, i + 1)
        dur[r][i], dur[r][i + 1] = 0.0, t
    return index, dur


def _window_positions(rows: list[list[Action]], tl: Timeline, t1: float, t2: float) -> tuple[list[int], list[int]]:
    """Per rank, the positions [begin, stop) of the passes that start in [t1, t2)."""
    R = len(rows)
    begin = [next((i for i, s in enumerate(tl.start[r]) if s >= t1), len(rows[r])) for r in range(R)]
    stop = [next((i for i, s in enumerate(tl.start[r]) if s >= t2), len(rows[r])) for r in range(R)]
    return begin, [max(x, y) for x, y in zip(begin, stop)]


class _WindowModel:
    """The MILP of one window, built in parts: time bounds, variables, precedence, then per
    rank the order (chains and order binaries) and memory rows; solved and decoded.

    Passes are keyed (rank, position). ``earliest[k]`` / ``latest_end[k]``: the earliest start
    and the latest end of pass k that can still beat the current objective (big-M constants).
    ``before[r][i]``: (k, weight) for each pass k of another chain on rank r that may run before
    pass i, weight 1 when it surely does, else the order binary (or 1 - it)."""

    asap = False  # (``_ChoiceModel``: each rank's start a variable held to its ASAP start)

    def __init__(self, problem: Problem, rows, tl: Timeline, begin: list[int], stop: list[int], band: float, secondary: bool,
                 relaxed: bool = False, pairs: list[list[int]] | None = None, paired: bool = True):
        self.problem, self.rows, self.tl, self.begin, self.stop = problem, rows, tl, begin, stop
        self.band, self.secondary = band, secondary
        self.deltas: list[list[float]] | None = None
        self.passes: list[Key] = [(r, i) for r in range(len(rows)) for i in range(begin[r], stop[r])]
        self.index = index = action_index(rows)
        self.inputs = {k: list(_inputs(problem, rows, index, *k)) for k in self.passes}
        self.dur = self.pass_durations()
        self.given_pairs = [sorted(p) for p in pairs] if pairs else [[] for _ in rows]
        self.y: dict[tuple[Key, Key], pulp.LpVariable] = {}  # (forward, backward) -> 1 where they run as a pair
        self.pair_time: dict[tuple[Key, Key], float] = {}
        self.partners: dict[Key, list[tuple[Key, Key]]] = {}
        self.paired = paired
        c = problem.cost
        # Sharded stages: the first pass of each stage on its rank waits for its gather
        # (``reductions.gather_releases``), and for the iteration each rank counts from its step's
        # start, the latest that lets every gather end by its stage's first pass
        self.release = {(r, i): t for r, row in enumerate(rows) for i, t in gather_releases(row, c.t_gather).items()}
        self.lane = problem.objective == "iteration" and c.has_reductions
        self.from_begin = self.lane and bool(c.t_gather)
        self.gather_at = [gather_ends({x.stage for x in row}, c.t_gather) if self.from_begin else {} for row in rows]
        # Each rank's span runs from its first pass (its step's start where it gathers). When
        # that pass is in the window its start is, with ``relaxed``, a variable: the model is then
        # the idle relaxation (a rank may start late), valid over every order, FIFO or not (see
        # ``problem``). Otherwise it is the rank's ASAP start under FIFO orders (F(s0, 0) as soon
        # as microbatch 0 arrives and its gather has ended), so that the model's value is the
        # simulator's for the FIFO orders it ranges over. A rank's later stages may end its step's
        # start earlier (``begin_cap``), which outside the idle relaxation is priced from the
        # earliest their first passes can start: never later than the simulator's.
        R = len(rows)
        self.lower = self.lower_starts()
        self.begin_cap = self.begin_caps(relaxed and not self.asap)
        if problem.objective == "makespan":
            self.off: list[float | None] = [0.0] * R
        else:
            fifo_start = self.fifo_starts(index)
            first = [(None if relaxed else fifo_start[r]) if begin[r] == 0 < stop[r]
                     else (tl.start[r][0] if begin[r] > 0 else fifo_start[r]) for r in range(R)]
            if self.from_begin:  # the step's start: the lowest stage's term, then the others' (``begin_cap``)
                lowest = [at[min(at)] if at else 0.0 for at in self.gather_at]
                first = [None if f is None else min(f - g, cap) for f, g, cap in zip(first, lowest, self.begin_cap)]
            self.off = first
        # For the iteration: per rank, where each stage's last backward is (its reduction's
        # input), and the optimizer steps that end the rank's iteration
        self.last = [last_backward(row) if self.lane else {} for row in rows]
        self.steps = [sum(c.t_opt[s] for s in {x.stage for x in row}) if self.lane else 0.0 for row in rows]
        marks = {("g", s): (r, p) for r, last in enumerate(self.last) for s, p in last.items() if p >= stop[r]}
        tail_index, tail_dur = _paired_after(problem.cost, rows, stop, index, self.dur, self.given_pairs)
        self.tail, self.rest = _tails(problem, rows, tl, begin, stop, tail_index, self.off, tail_dur, self.steps, marks,
                                      self.release)
        # the model's value of the given schedule: the simulator's, or more where a step's start is priced low
        self.value = problem.value(tl)
        if self.from_begin and tl.finish:
            self.value = max([self.value, *(f - o for f, o in zip(tl.finish, self.off) if o is not None),
                              *(f - cap for f, cap in zip(tl.finish, self.begin_cap))])
        self.slack = 1e-7 * max(1.0, self.value)  # float noise between the simulator's sums and ours
        self.binaries = 0

    def lower_starts(self) -> dict[Key, float]:
        """The earliest each pass of the window and after it can start in any order the model
        ranges over: after the passes before the window on its rank, its inputs and its gather;
        one after the window also after every window pass of its rank and the passes between."""
        rows, tl, begin, stop = self.rows, self.tl, self.begin, self.stop
        keys = sorted((tl.start[r][i], tl.end[r][i], r, i) for r in range(len(rows)) for i in range(begin[r], len(rows[r])))
        low: dict[Key, float] = {}
        for _, _, r, i in keys:
            if i > stop[r]:  # after the window, in its order
                t = low[(r, i - 1)] + self.dur[r][i - 1]
            elif i < stop[r] or begin[r] == stop[r]:  # after the passes before the window
                t = tl.end[r][begin[r] - 1] if begin[r] > 0 else 0.0
            else:  # the first pass after the window follows every window pass of its rank
                t = max(low[(r, k)] + self.dlo((r, k)) for k in range(begin[r], stop[r]))
            for pr, pi, delay in _inputs(self.problem, rows, self.index, r, i):
                t = max(t, (tl.end[pr][pi] if pi < begin[pr] else low[(pr, pi)] + self._least(pr, pi)) + delay)
            low[(r, i)] = max(t, self.release.get((r, i), 0.0))
        return low

    def _least(self, r: int, i: int) -> float:
        """The least pass i of rank r can take: ``dlo`` in the window, its cost after it."""
        return self.dlo((r, i)) if i < self.stop[r] else self.dur[r][i]

    def begin_caps(self, idle: bool) -> list[float]:
        """Per rank, where it counts from its step's start, the latest start its later stages'
        gathers leave it (each stage's first pass less its gather's end): exact for a pass before
        the window, else from the earliest it can start (``lower_starts``), so never later than
        the simulator's; ``idle``, the model's start variable takes those in the window exactly
        (``add_precedence``) and those after it are left out (a relaxation). Infinite where
        nothing caps it."""
        caps = [_INF] * len(self.rows)
        for r, row in enumerate(self.rows):
            first: dict[int, int] = {}
            for i, x in enumerate(row):
                first.setdefault(x.stage, i)
            if not first or not self.from_begin:
                continue
            ends, s0 = self.gather_at[r], min(first)
            variable = idle and self.begin[r] == 0 < self.stop[r]
            for s, i in first.items():
                if ends[s] <= ends[s0]:
                    continue  # its term is never below the lowest stage's
                if i < self.begin[r]:
                    caps[r] = min(caps[r], self.tl.start[r][i] - ends[s])
                elif not variable:
                    caps[r] = min(caps[r], self.lower[(r, i)] - ends[s])
        return caps

    def pass_durations(self) -> list[list[float]]:
        """What each pass of the schedule costs (``CostModel.durations``)."""
        return self.problem.cost.durations(self.rows)

    def fifo_starts(self, index) -> list[float]:
        """Per rank, the ASAP start of its first pass under FIFO orders: when microbatch 0's
        forwards reach its lowest stage (``earliest_starts``, on the schedule's own durations)."""
        c = self.problem.cost
        arrive, t = [], 0.0
        for s in range(c.num_stages):
            r, i = index[(s, Op.F, 0)]
            t = max(t, self.release.get((r, i), 0.0))  # its gather, where it is its rank's first of the stage
            arrive.append(t)
            t = t + self.dur[r][i] + (edge_delay(c, s, s + 1) if s + 1 < c.num_stages else 0.0)
        return [arrive[min(c.rank_stages(r))] for r in range(c.num_ranks)]

    def duration(self, k: Key):
        """How long pass k takes: a number, or where it may run in an overlapped pair, its time
        alone plus, for the pair chosen, what the pair adds (both passes of a pair end at its
        start plus ``CostModel.pair_time``); an affine expression where the model chooses."""
        d = self.dur[k[0]][k[1]]
        keys = self.partners.get(k)
        if not keys:
            return d
        return d + pulp.lpSum((self.pair_time[key] - d) * self.y[key] for key in keys)

    def dlo(self, k: Key) -> float:
        """The least pass k can take (what its time bounds use)."""
        return self.dur[k[0]][k[1]]

    def memory_delta(self, r: int, i: int) -> float:
        """How pass i of rank r changes its memory (``CostModel.memory_deltas``: the window keeps
        each microbatch's recomputation as it is, so what each pass allocates is fixed)."""
        if self.deltas is None:
            self.deltas = self.problem.cost.memory_deltas(self.rows)
        return self.deltas[r][i]

    # ---- time bounds -----------------------------------------------------------------------

    def time_bounds(self) -> bool:
        """Earliest starts (prefix constants + precedence inside the window) and latest ends;
        False if they contradict each other (cannot happen for a consistent timeline)."""
        tl, begin = self.tl, self.begin
        order = sorted(self.passes, key=lambda k: (tl.start[k[0]][k[1]], k))
        self.earliest: dict[Key, float] = {}
        for r, i in order:
            t = tl.end[r][begin[r] - 1] if begin[r] > 0 else 0.0
            for pr, pi, delay in self.inputs[(r, i)]:
                t = max(t, (tl.end[pr][pi] if pi < begin[pr] else self.earliest[(pr, pi)] + self.dlo((pr, pi))) + delay)
            self.earliest[(r, i)] = max(t, self.release.get((r, i), 0.0))
        # A horizon every pass can be assumed to end by: left-shift any schedule until its
        # ranks' busy intervals (each at most the objective long) and the messages between
        # them leave no idle gap.
        delay = max((d for k in self.passes for _, _, d in self.inputs[k]), default=0.0)
        R = len(self.rows)
        self.horizon = max(self.earliest.values()) + R * (self.value + self.slack) + (R - 1) * delay + 1.0
        latest: dict[tuple[int, int], float] = {}
        self.latest_end = latest
        for k in self.passes:
            own = self.tail[k].get(None)
            latest[k] = min(self.horizon, self.value + self.slack - own) if own is not None else self.horizon
        successors: dict[Key, list[tuple[Key, float]]] = {}
        for k in self.passes:
            for pr, pi, delay in self.inputs[k]:
                if (pr, pi) in latest:
                    successors.setdefault((pr, pi), []).append((k, delay))
        for k in reversed(order):
            for sk, delay in successors.get(k, ()):
                latest[k] = min(latest[k], latest[sk] - self.dlo(sk) - delay)
        return all(self.earliest[k] + self.dlo(k) <= latest[k] + 1e-6 for k in self.passes)

    # ---- the model -------------------------------------------------------------------------

    def add_variables(self) -> None:
        """A start time per pass and the objective ``z``; the current schedule as warm start."""
        tl, lp = self.tl, pulp.LpProblem("window", pulp.LpMinimize)
        self.lp = lp
        name = {k: f"s{k[0]}_{k[1]}" for k in self.passes}
        self.start = {k: _variable(lp, name[k], self.earliest[k], self.latest_end[k] - self.dlo(k)) for k in self.passes}
        rest = self.rest[None]
        self.z = _variable(lp, "z", rest if rest > _NEG else None, self.value + self.slack)
        self.warm_start = {name[k]: tl.start[k[0]][k[1]] for k in self.passes}
        self.warm_start["z"] = self.value
        # the start of each rank whose first pass is in the window
        self.rank_start = {r: _variable(lp, f"t{r}", 0.0, self.horizon) for r, o in enumerate(self.off) if o is None}
        self.warm_start.update({f"t{r}": min(tl.begin[r] if self.from_begin else tl.start[r][0], self.begin_cap[r])
                                for r in self.rank_start})
        self.add_pairs()

    def pairs_allowed(self) -> bool:
        """Whether the model chooses overlapped pairs: where the passes hold all-to-all, if asked."""
        return self.paired and self.problem.cost.has_all_to_all

    def pair_candidate(self, r: int, i: int, k: int, given: bool) -> bool:
        """Whether forward i and backward k of rank r may run as one overlapped pair: another
        microbatch, no order between them fixed by a dependency or the band, a pair that hides
        something (one that hides nothing is no better than the two passes in turn) and that the
        time bounds leave room for; a pair of the given schedule always (its warm start)."""
        f, b = self.rows[r][i], self.rows[r][k]
        if f.mb == b.mb:
            return False
        if given:
            return True
        S = self.problem.cost.num_stages
        if (f.mb <= b.mb and must_precede((f.stage, Op.F), _chain(b), S)) or \
                (b.mb <= f.mb and must_precede(_chain(b), (f.stage, Op.F), S)):
            return False
        if abs(self.tl.start[r][i] - self.tl.start[r][k]) > self.band:
            return False
        c = self.problem.cost
        combos = [(df, db) for _, df in self.options((r, i)) for _, db in self.options((r, k))]
        if all(c.pair_time(f, b, df, db) >= df + db - EPS_MS for df, db in combos):
            return False
        t = min(c.pair_time(f, b, df, db) for df, db in combos)
        ki, kk = (r, i), (r, k)
        lo = max(self.earliest[ki], self.earliest[kk])
        return lo + t <= min(self.latest_end[ki], self.latest_end[kk]) + EPS_MS

    def options(self, k: Key) -> list[tuple[object, float]]:
        """What pass k may cost: (indicator, duration) per choice, the indicator 1 in an integer
        solution exactly where that choice is made (here one: its cost in the given schedule)."""
        return [(1, self.dur[k[0]][k[1]])]

    def add_pairs(self) -> None:
        """Where the passes hold all-to-all: a binary y per candidate (forward, backward) pair of
        a rank (``pair_candidate``), at most one partner per pass; a pair's passes start
        together and end at its start plus ``pair_time`` (``duration``); ``add_order`` lets the
        two overlap, the forward first in the order (its memory counts first, as in the
        simulator). The given schedule's pairs in the window are the warm start."""
        if not self.pairs_allowed():
            return
        lp, start, c = self.lp, self.start, self.problem.cost
        for r, row in enumerate(self.rows):
            given = set(self.given_pairs[r])
            window = range(self.begin[r], self.stop[r])
            backs = [k for k in window if row[k].op in (Op.B, Op.BW)]
            for i in window:
                if row[i].op is not Op.F:
                    continue
                for k in backs:
                    if not self.pair_candidate(r, i, k, i in given and k == i + 1):
                        continue
                    key = ((r, i), (r, k))
                    y = self.y[key] = _variable(lp, f"y{r}_{i}_{k}", 0, 1, pulp.LpBinary)
                    self.warm_start[y.name] = 1.0 if i in given and k == i + 1 else 0.0
                    self.binaries += 1
                    self.pair_time[key] = c.pair_time(row[i], row[k], self.dur[r][i], self.dur[r][k])
                    self.partners.setdefault((r, i), []).append(key)
                    self.partners.setdefault((r, k), []).append(key)
        self.add_pair_durations()
        for one, keys in self.partners.items():
            if len(keys) > 1:
                lp += pulp.lpSum(self.y[key] for key in keys) <= 1
            lp += start[one] + self.duration(one) <= self.latest_end[one]  # (the time bounds assumed the pass alone)
        for (ki, kk), y in self.y.items():
            big = max(self.latest_end[ki] - self.dlo(ki) - self.earliest[kk],
                      self.latest_end[kk] - self.dlo(kk) - self.earliest[ki], 0.0)
            lp += start[ki] - start[kk] <= big * (1 - y)
            lp += start[kk] - start[ki] <= big * (1 - y)

    def add_pair_durations(self) -> None:
        """Where a pass's time alone depends on the model's choices, what ties a pair's time to
        them (none here: ``duration`` takes the pair's constant time)."""

    def add_objective(self) -> None:
        """z, plus (``secondary``) a tiny weight on the start times so passes start early."""
        self.eps = 1e-6 / len(self.passes) if self.secondary else 0.0
        self.lp += self.z + self.eps * pulp.lpSum(self.start.values())

    def add_precedence(self) -> None:
        """Dependencies inside the window, and z above each pass's end plus its tail."""
        lp, start = self.lp, self.start
        for k in self.passes:
            for pr, pi, delay in self.inputs[k]:
                if (pr, pi) in start:
                    lp += start[k] >= start[(pr, pi)] + self.duration((pr, pi)) + delay
            for label, t in self.tail[k].items():
                if isinstance(label, tuple):
                    continue  # the end of a stage's last backward: the lane's (``ready``)
                lp += self.z >= start[k] + self.duration(k) + t - (self.rank_start[label] if label is not None else 0.0)
            if k[0] in self.rank_start:  # from the rank's step start, its gathers end before each stage's first pass
                lp += self.rank_start[k[0]] <= start[k] - self.gathered(k)
        for r, t0 in self.rank_start.items():
            if self.rest[r] > _NEG:
                lp += self.z >= self.rest[r] - t0
            if self.begin_cap[r] < _INF:
                lp += t0 <= self.begin_cap[r]

    def gathered(self, k: Key) -> float:
        """Where the rank counts from its step's start: the end of the rank's gathers up to pass
        k's stage (``reductions.gather_ends``), which its first pass of the stage, and so every
        later one, starts after; else 0."""
        r, i = k
        return self.gather_at[r].get(self.rows[r][i].stage, 0.0)

    def add_lane(self) -> None:
        """For the iteration, each rank's reduction lane (``zbsearch.reductions``): z above the end
        of its lane plus its optimizer steps, from its start. A stage's reduction is ready when
        its last backward ends (``ready``); the lane runs one at a time in an order of the
        model's choice (``lane_end``). The rule runs them in the order they become ready, which
        ends no later than any other order (a single machine with release times ends first in
        release order), so the least over orders is the rule's."""
        if not self.lane:
            return
        for r, last in enumerate(self.last):
            t = self.problem.cost.t_reduce
            ready = {s: self.ready(r, s, p) for s, p in last.items() if t[s] > 0}
            if not ready:
                continue  # no reduction: the rank's span and steps, as ``add_precedence`` has them
            t0 = self.rank_start.get(r)
            start = t0 if t0 is not None else self.off[r]
            self.lp += self.z >= self.lane_end(r, ready) + self.steps[r] - start

    def ready(self, r: int, s: int, p: int):
        """When stage s's reduction becomes ready: the end of its last backward (position p on
        rank r in the current schedule), a constant where that is before the window, else a
        variable above the end of each backward of s in the window or, where the last one is
        after the window, above its end through its tail."""
        if p < self.begin[r]:
            return self.tl.end[r][p]
        lp, start = self.lp, self.start
        g = _variable(lp, f"g{s}", None, None)
        self.warm_start[g.name] = self.tl.end[r][p]
        if p < self.stop[r]:
            for i in range(self.begin[r], self.stop[r]):
                x = self.rows[r][i]
                if x.stage == s and x.op in (Op.W, Op.BW):
                    lp += g >= start[(r, i)] + self.duration((r, i))
            return g
        label = ("g", s)
        for k in self.passes:
            tail = self.tail[k].get(label)
            if tail is not None:
                lp += g >= start[k] + self.duration(k) + tail
        if self.rest[label] > _NEG:
            lp += g >= self.rest[label]
        return g

    def lane_end(self, r: int, ready: dict):
        """The end of rank r's lane, given when each stage's reduction is ready: a constant where
        every one is, else a variable above each reduction's end, each reduction starting when
        ready and the pairs ordered by a binary (the current order as the warm start)."""
        t = self.problem.cost.t_reduce
        if all(isinstance(v, (int, float)) for v in ready.values()):
            runs = lane_runs(sorted((v, t[s]) for s, v in ready.items()))
            return runs[-1][1]
        if len(ready) == 1:
            ((one, v),) = ready.items()
            return v + t[one]
        lp = self.lp
        # the warm start: the current schedule's lane, by the rule
        at = {s: v if isinstance(v, (int, float)) else self.warm_start[v.name] for s, v in ready.items()}
        order = sorted(ready, key=lambda s: at[s])
        done = dict(zip(order, lane_runs([(at[x], t[x]) for x in order])))
        # every reduction starts by when the objective's bound lets the lane end
        top = self.value + self.slack + (self.horizon if r in self.rank_start else (self.off[r] or 0.0))
        end = _variable(lp, f"lane{r}", None, None)
        self.warm_start[end.name] = max(b for _, b in done.values())
        begins = {}
        for s, v in ready.items():
            x = begins[s] = _variable(lp, f"red{r}_{s}", 0.0, top)
            self.warm_start[x.name] = done[s][0]
            lp += x >= v
            lp += end >= x + t[s]
        stages = sorted(ready)
        for n, a in enumerate(stages):
            for b in stages[n + 1:]:
                y = _variable(lp, f"ro{r}_{a}_{b}", 0, 1, pulp.LpBinary)  # 1: a's reduction first
                self.warm_start[y.name] = 1.0 if done[a][0] <= done[b][0] else 0.0
                self.binaries += 1
                lp += begins[b] >= begins[a] + t[a] - (top + t[a]) * (1 - y)
                lp += begins[a] >= begins[b] + t[b] - (top + t[b]) * y
        return end

    def add_order_and_memory(self) -> None:
        """Per rank: its chains in microbatch order, the order between chains, its memory rows."""
        self.chain_position: dict[Key, int] = {}
        self.before: list[dict[int, list]] = []
        limits = self.problem.allowed()
        for r in range(len(self.rows)):
            chains = self.add_chains(r)
            self.before.append({i: [] for i in range(self.begin[r], self.stop[r])})
            keys = list(chains)
            for ci, X in enumerate(keys):
                for Y in keys[ci + 1:]:
                    for i in chains[X]:
                        self.add_order(r, X, Y, i, chains[Y])
            if math.isfinite(limits[r]):
                self.add_memory(r, chains, limits[r])

    def add_chains(self, r: int) -> dict[PassType, list[int]]:
        """Rank r's window passes by chain (``_chain``), each chain in microbatch order (FIFO)."""
        chains: dict[PassType, list[int]] = {}
        for i in range(self.begin[r], self.stop[r]):
            chains.setdefault(_chain(self.rows[r][i]), []).append(i)
        for ids in chains.values():
            self.chain_position.update(((r, i), pos) for pos, i in enumerate(ids))
            for i0, i1 in zip(ids, ids[1:]):
                self.lp += self.start[(r, i1)] >= self.start[(r, i0)] + self.duration((r, i0))
        return chains

    def add_order(self, r: int, X: PassType, Y: PassType, i: int, others: list[int]) -> None:
        """Order pass i (chain X) against the passes of chain Y: fixed by a dependency, by the
        band or by the time bounds, else by a binary; linked to the nearest fixed pass on each
        side (the chain order implies the rest; where chain Y has no fixed order, to every one)."""
        lp, start, rows, tl, S = self.lp, self.start, self.rows, self.tl, self.problem.cost.num_stages
        earliest, latest, dur, lo, before = self.earliest, self.latest_end, self.duration, self.dlo, self.before[r]
        xi = rows[r][i]
        last_before = first_after = None
        ordered = self.fifo_chain(Y)
        for k in others:
            yk = rows[r][k]
            pair = self.y.get(((r, i), (r, k)) if xi.op is Op.F else ((r, k), (r, i)))
            if pair is not None:
                self.add_pair_order(r, i, k, pair)
            elif (xi.mb <= yk.mb and must_precede(X, Y, S)) or tl.start[r][k] - tl.start[r][i] > self.band:
                first_after = k if first_after is None else first_after
                before[k].append((i, 1))
                if not ordered:
                    lp += start[(r, k)] >= start[(r, i)] + dur((r, i))
            elif (yk.mb <= xi.mb and must_precede(Y, X, S)) or tl.start[r][i] - tl.start[r][k] > self.band:
                last_before = k
                before[i].append((k, 1))
                if not ordered:
                    lp += start[(r, i)] >= start[(r, k)] + dur((r, k))
            elif earliest[(r, k)] + lo((r, k)) > latest[(r, i)] - lo((r, i)) + EPS_MS:
                # y cannot end before x must start: y's order is forced after x
                lp += start[(r, k)] >= start[(r, i)] + dur((r, i))
                before[k].append((i, 1))
            elif earliest[(r, i)] + lo((r, i)) > latest[(r, k)] - lo((r, k)) + EPS_MS:
                lp += start[(r, i)] >= start[(r, k)] + dur((r, k))
                before[i].append((k, 1))
            else:
                v = _variable(lp, f"o{r}_{i}_{k}", 0, 1, pulp.LpBinary)  # 1: i before k
                self.warm_start[v.name] = 1.0 if (tl.start[r][i], i) < (tl.start[r][k], k) else 0.0
                self.binaries += 1
                m1 = latest[(r, i)] - earliest[(r, k)]
                m2 = latest[(r, k)] - earliest[(r, i)]
                lp += start[(r, k)] >= start[(r, i)] + dur((r, i)) - m1 * (1 - v)
                lp += start[(r, i)] >= start[(r, k)] + dur((r, k)) - m2 * v
                before[k].append((i, v))
                before[i].append((k, 1 - v))
        if last_before is not None and ordered:
            lp += start[(r, i)] >= start[(r, last_before)] + dur((r, last_before))
        if first_after is not None and ordered:
            lp += start[(r, first_after)] >= start[(r, i)] + dur((r, i))

    def add_pair_order(self, r: int, i: int, k: int, pair) -> None:
        """Order passes i and k of rank r, which may run as an overlapped pair (binary ``pair``),
        by a binary as ``add_order`` does, the order rows lifted where they pair; paired, the
        forward is first."""
        lp, start, dur, latest, earliest = self.lp, self.start, self.duration, self.latest_end, self.earliest
        v = _variable(lp, f"o{r}_{i}_{k}", 0, 1, pulp.LpBinary)  # 1: i before k
        self.warm_start[v.name] = 1.0 if (self.tl.start[r][i], i) < (self.tl.start[r][k], k) else 0.0
        self.binaries += 1
        m1 = latest[(r, i)] - earliest[(r, k)]
        m2 = latest[(r, k)] - earliest[(r, i)]
        if self.rows[r][i].op is Op.F:
            lp += start[(r, k)] >= start[(r, i)] + dur((r, i)) - m1 * (1 - v) - max(m1, 0.0) * pair
            lp += start[(r, i)] >= start[(r, k)] + dur((r, k)) - m2 * v
            lp += v >= pair
        else:
            lp += start[(r, k)] >= start[(r, i)] + dur((r, i)) - m1 * (1 - v)
            lp += start[(r, i)] >= start[(r, k)] + dur((r, k)) - m2 * v - max(m2, 0.0) * pair
            lp += v <= 1 - pair
        self.before[r][k].append((i, v))
        self.before[r][i].append((k, 1 - v))

    def fifo_chain(self, chain: PassType) -> bool:
        """Whether the chain's passes run in a fixed order (all of them here)."""
        return True

    def add_memory(self, r: int, chains: dict[PassType, list[int]], allowed: float) -> None:
        """Memory after each allocating pass: memory before the window + deltas of what precedes."""
        mem_at_begin = self.tl.memory[r][self.begin[r] - 1] if self.begin[r] > 0 else 0.0
        delta = self.memory_delta
        for ids in chains.values():
            for pos, i in enumerate(ids):
                d = delta(r, i)
                if d <= 0:
                    continue
                expr = pulp.lpSum(delta(r, k) * w for k, w in self.before[r][i])
                own = self.own_memory(r, ids, pos)
                if isinstance(own, (int, float)):
                    self.lp += expr + (mem_at_begin + own + d) <= allowed
                else:  # an expression in the model's choices
                    self.lp += expr + own + (mem_at_begin + d) <= allowed

    def own_memory(self, r: int, ids: list[int], pos: int):
        """What the passes of its own chain that run before pass ``ids[pos]`` hold."""
        return sum(self.memory_delta(r, k) for k in ids[:pos])

    # ---- solve and decode ------------------------------------------------------------------

    def solve(self, time_limit: float) -> WindowResult | None:
        solver = _HiGHS(self.warm_start, time_limit, msg=False, threads=os.cpu_count() or 1,
                        gapRel=1e-6 if not self.secondary else 1e-5)
        self.lp.solve(solver)
        if self.lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return None
        optimal = solver.model_status == highspy.HighsModelStatus.kOptimal
        bound = solver.dual_bound - (self.eps * sum(self.latest_end[k] for k in self.passes) if self.eps else 0.0)
        rows = self.decode()
        return WindowResult(rows, pulp.value(self.z), bound, optimal, self.binaries, self.decode_pairs(rows))

    def decode_pairs(self, new_rows: list[list[Action]]) -> list[list[int]] | None:
        """The overlapped pairs of ``new_rows`` (None: none): those the model chose, and the given
        ones outside the window, each where its forward now is."""
        chosen = [key for key, y in self.y.items() if round(pulp.value(y)) == 1]
        kept = [((r, i), (r, i + 1)) for r, at in enumerate(self.given_pairs) for i in at
                if not self.begin[r] <= i < self.stop[r]]
        out: list[list[int]] = [[] for _ in new_rows]
        where: dict[int, dict[Action, int]] = {}
        for (r, i), (_, k) in chosen + kept:
            at = where.get(r)
            if at is None:
                at = where[r] = {a: n for n, a in enumerate(new_rows[r])}
            f, b = at.get(self.as_run(self.rows[r][i])), at.get(self.as_run(self.rows[r][k]))
            if f is not None and b == f + 1:
                out[r].append(f)
        return [sorted(p) for p in out] if any(out) else None

    def as_run(self, x: Action) -> Action:
        """Action x of the model's rows as the decoded rows hold it (the same here)."""
        return x

    def decode(self) -> list[list[Action]]:
        """New order per rank: a pass's position is the number of window passes before it, read
        from the order terms (exact even for passes of zero length, unlike start times)."""
        rows = self.rows
        new_rows = [list(row) for row in rows]
        for r in range(len(rows)):
            pos = {
                i: self.chain_position[(r, i)]
                + sum(w if isinstance(w, int) else round(pulp.value(w)) for _, w in self.before[r][i])
                for i in range(self.begin[r], self.stop[r])
            }
            new_rows[r][self.begin[r]:self.stop[r]] = [rows[r][i] for i in sorted(pos, key=lambda i: pos[i])]
        return new_rows


def solve_window(
    problem: Problem,
    rows: list[list[Action]],
    tl: Timeline,
    t1: float,
    t2: float,
    band: float,
    time_limit: float,
    secondary: bool = True,
    relaxed: bool = False,
    pairs: list[list[int]] | None = None,
    paired: bool = True,
) -> WindowResult | None:
    """Re-optimise the passes that start in [t1, t2); None if the window is empty.
    ``relaxed``: each rank's start is free (the idle relaxation; see ``_WindowModel``).
    ``pairs``: the overlapped pairs of ``rows`` (``tl`` times them): those outside the window
    stay, those inside are the warm start of the window's choice of pairs (``paired``: where
    the passes hold all-to-all, the window chooses pairs; else it keeps none of its own)."""
    begin, stop = _window_positions(rows, tl, t1, t2)
    if begin == stop:
        return None
    model = _WindowModel(problem, rows, tl, begin, stop, band, secondary, relaxed, pairs, paired)
    if not _build(model):
        return None  # cannot happen for a consistent timeline; be safe rather than wrong
    return model.solve(time_limit)


class _ChoiceModel(_WindowModel):
    """The exact model (the whole schedule, no band) where each microbatch's backward on each
    stage of ``choice`` is fused or split (a binary u per (stage, microbatch)) and, where the
    costs offer recomputation, each microbatch's forward on each stage that offers it runs
    plain or checkpointed for one of the recompute passes offered (a binary x per (stage,
    microbatch, pass); at most one, exactly one with "full").

    The rows are in split form (a B and a W for every backward) and u says what they are: fused,
    the B is the BW (t_bw, and then its F costs t_ff) and the W a pass of no length at the BW's
    end, whose memory change happens there (a BW's memory changes at once); split, they are
    the B and the W. Each (stage, microbatch) that may be recomputed has a recompute slot, an
    ``Op.R`` action after its F and before its backward on their rank (a chain of its own, in
    microbatch order): where an x is set it is that recompute pass (its time, before a fused
    backward t_rf; it allocates m_f - keep) and the F costs and keeps what a checkpointed one
    does; otherwise it is a point of no length and no memory. Durations and memory deltas are
    affine in u and x, with a product variable where a time depends on both; time bounds and
    big-M constants use the least. Memory after a pass sums the deltas of the passes ordered
    before it: a delta that depends on x times an order binary is a product, linearised exactly
    (``_memory_term``).

    FIFO loses nothing in the idle relaxation here as well (``problem``) once an F's price is
    not tied to its own microbatch's choice: relabelling two microbatches on their backward work
    (which sorts the backwards) swaps that work and its choices but not their earlier forwards.
    So with ``relaxed`` each F has its own binary a (it costs t_ff, else t_f), and on each stage
    as many F cost t_ff as backwards are fused: relabelling keeps both counts, so every split,
    fused or mixed schedule maps onto a FIFO solution of this model, whose dual bound is then a
    lower bound for all of them. The forward and backward chains keep microbatch order; the W
    passes of a stage keep it among the split ones only (a fused one sits at its BW's end,
    wherever that is). No such argument is known with recomputation (``problem``): there the F
    is priced by its own microbatch's choice and the model is FIFO orders only, never a bound.

    Overlapped pairs (where the passes hold all-to-all) join as in a window, except that a
    pass's time alone and its pair's depend on the choices: each pass that may pair gets a
    duration variable, equal to its time alone unless paired and to the pair's time under the
    choices made when paired (``add_pair_durations``).

    Without ``relaxed`` (span): each rank starts as soon as microbatch 0's forwards reach it,
    an affine expression in their choices, and F costs t_ff where fused: the best FIFO order
    and choice under ASAP execution, as the simulator times it."""

    def __init__(self, problem: Problem, rows, tl: Timeline, fused: set[tuple[int, int]], choice: set[int],
                 relaxed: bool, checkpointed: dict[tuple[int, int], Op] | None = None, pairs: list[list[int]] | None = None):
        c = problem.cost
        self.fused0, self.choice, self.ckpt0 = fused, choice, checkpointed or {}
        self.offers = {s: ops for s in range(c.num_stages) if (ops := c.recompute_ops(s))}
        self.asap = not relaxed and problem.spans
        self.choices_made = False  # (the pairs join once the choice variables exist)
        self.pair_dur: dict[Key, pulp.LpVariable] = {}
        self.run_as: tuple[set[tuple[int, int]], dict[tuple[int, int], Op]] = (set(), {})
        super().__init__(problem, rows, tl, [0] * len(rows), [len(row) for row in rows], _INF, False, relaxed=True,
                         pairs=pairs)

    def cost_of(self, x: Action, fused: bool) -> float:
        c = self.problem.cost
        if x.op is Op.F:
            return c.t_ff[x.stage] if fused else c.t_f[x.stage]
        if x.op is Op.B:
            return c.t_bw[x.stage] if fused else c.t_b[x.stage]
        return 0.0 if fused else c.t_w[x.stage]

    def _offer(self, s: int, op: Op) -> Recompute:
        offer = self.problem.cost.offer(s, op)
        assert offer is not None
        return offer

    def price(self, x: Action) -> float:
        """What pass x costs in the given schedule (``CostModel.durations``)."""
        fused, op = (x.stage, x.mb) in self.fused0, self.ckpt0.get((x.stage, x.mb))
        if x.op is Op.R:  # a recompute slot
            return 0.0 if op is None else self._offer(x.stage, op).time(fused)
        if x.op is Op.F and op is not None:
            return self._offer(x.stage, op).t_f
        return self.cost_of(x, fused)

    def pass_durations(self) -> list[list[float]]:
        return [[self.price(x) for x in row] for row in self.rows]

    def chosen(self, k: Key) -> bool:
        x = self.rows[k[0]][k[1]]
        return x.stage in self.choice or (x.op in (Op.F, Op.R) and x.stage in self.offers)

    def duration(self, k: Key):
        """Its time alone (``alone``) or, where it may pair, a variable equal to it unpaired and to
        the pair's time paired (``add_pair_durations``)."""
        d = self.pair_dur.get(k)
        return d if d is not None else self.alone(k)

    def alone(self, k: Key):
        """Pass k's time run alone, affine in the model's choices."""
        x = self.rows[k[0]][k[1]]
        s, j = x.stage, x.mb
        ops = self.offers.get(s, ())
        if x.op is Op.R:  # the pass chosen, t_rf where its backward is fused
            out = 0.0
            for op in ops:
                o = self._offer(s, op)
                out = out + o.t_r * self.x[(s, j, op)]
                if (s, j, op) in self.rf:
                    out = out + (o.time(True) - o.t_r) * self.rf[(s, j, op)]
            return out
        split = self.cost_of(x, False)
        other = self.cost_of(x, True) - split
        out = split if x.stage not in self.choice or other == 0 else \
            split + other * (self.a if x.op is Op.F else self.u)[(s, j)]
        if x.op is Op.F and ops:  # checkpointed: its own price, fused or not
            out = out + pulp.lpSum((self._offer(s, op).t_f - split) * self.x[(s, j, op)] for op in ops)
            out = out - pulp.lpSum(other * self.ff[(s, j, op)] for op in ops if (s, j, op) in self.ff)
        return out

    def options(self, k: Key) -> list[tuple[object, float]]:
        """What forward or backward k may cost alone, per choice: (indicator, duration), the
        indicator (affine in the choice variables) 1 in an integer solution exactly where the
        choice is made: a B split or fused; an F plain, fused (t_ff) or checkpointed."""
        x, c = self.rows[k[0]][k[1]], self.problem.cost
        s, j = x.stage, x.mb
        if x.op is Op.B:
            if s not in self.choice:
                return [(1, c.t_b[s])]
            u = self.u[(s, j)]
            return [(1 - u, c.t_b[s]), (u, c.t_bw[s])]
        if x.op is not Op.F:
            return [(1, self.dur[k[0]][k[1]])]
        ops = self.offers.get(s, ())
        out: list[tuple[object, float]] = []
        plain = 1
        if s in self.choice and c.t_ff[s] != c.t_f[s]:  # fused and not checkpointed (``ff``: both)
            fused = self.a[(s, j)] - pulp.lpSum(self.ff[(s, j, op)] for op in ops)
            out.append((fused, c.t_ff[s]))
            plain = plain - fused
        for op in ops:
            out.append((self.x[(s, j, op)], self._offer(s, op).t_f))
            plain = plain - self.x[(s, j, op)]
        return [(plain, c.t_f[s]), *out]

    def add_pairs(self) -> None:
        if self.choices_made:  # (the base's ``add_variables`` calls it before the choices exist)
            super().add_pairs()

    def add_pair_durations(self) -> None:
        """Per pass that may pair, a variable d: its time alone where unpaired, and for the pair
        chosen ``CostModel.pair_time`` of the two passes' times under the choices made, one row
        pair per combination of their choices, lifted unless it is the one made (exact in every
        integer solution; the rule is used as it stands, not assumed separable)."""
        lp, c, rows, tl = self.lp, self.problem.cost, self.rows, self.tl
        for k, keys in self.partners.items():
            alone = self.alone(k)
            rowsets = []
            for key in keys:
                (r, i), (_, n) = key
                for ind_f, df in self.options((r, i)):
                    for ind_b, db in self.options((r, n)):
                        rowsets.append((key, ind_f, ind_b, c.pair_time(rows[r][i], rows[r][n], df, db)))
            big = 1.0 + max([t for *_, t in rowsets] + [d for _, d in self.options(k)] + [self.dur[k[0]][k[1]]])
            d = self.pair_dur[k] = _variable(lp, f"d{k[0]}_{k[1]}", 0.0, big)
            self.warm_start[d.name] = tl.end[k[0]][k[1]] - tl.start[k[0]][k[1]]
            paired = pulp.lpSum(self.y[key] for key in keys)
            lp += d >= alone - big * paired
            lp += d <= alone + big * paired
            for key, ind_f, ind_b, t in rowsets:
                miss = 3 - self.y[key] - ind_f - ind_b
                lp += d >= t - big * miss
                lp += d <= t + big * miss

    def as_run(self, x: Action) -> Action:
        return _decoded(x, *self.run_as)

    def dlo(self, k: Key) -> float:
        x = self.rows[k[0]][k[1]]
        if x.op is Op.R:
            return 0.0
        least = min(self.cost_of(x, False), self.cost_of(x, True)) if x.stage in self.choice else self.cost_of(x, False)
        if x.op is Op.F and x.stage in self.offers:
            least = min([least, *(self._offer(x.stage, op).t_f for op in self.offers[x.stage])])
        return least

    def memory_delta(self, r: int, i: int) -> float:
        """The part of pass i's memory change that no recomputation choice moves (a slot's: none)."""
        x = self.rows[r][i]
        return 0.0 if x.op is Op.R else self.problem.cost.memory(x.stage, x.op)

    def moved(self, r: int, i: int):
        """What recomputation moves from pass i's F to its recompute slot: m_f - keep of the pass
        chosen (None where nothing can move)."""
        x = self.rows[r][i]
        if x.op not in (Op.F, Op.R) or x.stage not in self.offers:
            return None
        return self.g[(x.stage, x.mb)]

    def add_variables(self) -> None:
        super().add_variables()
        lp, start, c = self.lp, self.start, self.problem.cost
        self.u = {}
        m = self.problem.num_microbatches
        for s in sorted(self.choice):
            for j in range(m):
                self.u[(s, j)] = _variable(lp, f"u{s}_{j}", 0, 1, pulp.LpBinary)
                self.warm_start[f"u{s}_{j}"] = 1.0 if (s, j) in self.fused0 else 0.0
        self.add_recompute_variables()
        # which forwards cost t_ff: their own microbatch's choice, or (relaxed) as many per stage
        self.a = self.u
        if not self.asap and not self.offers:
            self.a = {}
            for s in sorted(x for x in self.choice if c.t_ff[x] != c.t_f[x]):
                for j in range(m):
                    self.a[(s, j)] = _variable(lp, f"a{s}_{j}", 0, 1, pulp.LpBinary)
                    self.warm_start[f"a{s}_{j}"] = self.warm_start[f"u{s}_{j}"]
                lp += pulp.lpSum(self.a[(s, j)] for j in range(m)) == pulp.lpSum(self.u[(s, j)] for j in range(m))
        # a checkpointed F costs its own price whether fused or not: the product of a and x undoes t_ff
        self.ff = {(s, j, op): self._product(self.a[(s, j)], v, f"ff{s}_{j}_{op.value}")
                   for (s, j, op), v in self.x.items() if s in self.choice and c.t_ff[s] != c.t_f[s]}
        # before a fused backward, full recomputation costs t_rf: the product of u and x adds t_rf - t_r
        self.rf = {(s, j, op): self._product(self.u[(s, j)], v, f"rf{s}_{j}_{op.value}")
                   for (s, j, op), v in self.x.items() if s in self.choice and (o := self._offer(s, op)).time(True) != o.t_r}
        self.choices_made = True
        self.add_pairs()
        for k in self.passes:
            if self.chosen(k):  # the time bounds took the least duration: the end must still fit
                lp += start[k] + self.duration(k) <= self.latest_end[k]
        for (s, j), u in self.u.items():  # a fused W: no length, at its BW's end
            kb, kw = self.index[(s, Op.B, j)], self.index[(s, Op.W, j)]
            big = max(0.0, self.latest_end[kw] - self.earliest[kb] - self.dlo(kb))
            lp += start[kw] <= start[kb] + self.duration(kb) + big * (1 - u)
        if self.asap:  # each rank starts when microbatch 0's forwards reach it, each after its gather
            for r, t0 in self.rank_start.items():
                s0 = min(c.rank_stages(r))
                path = 0.0
                for s in range(s0 + 1):
                    k = self.index[(s, Op.F, 0)]
                    if self.release.get(k, 0.0) > 0:
                        path = self.at_least(path, self.release[k], f"arr{r}_{s}")
                    if s < s0:
                        path = path + self.duration(k) + edge_delay(c, s, s + 1)
                if self.from_begin:  # the step's start, at most (``add_precedence`` caps it by the later stages)
                    lp += t0 <= path - self.gathered(self.index[(s0, Op.F, 0)])
                else:
                    lp += t0 == path

    def at_least(self, x, floor: float, name: str):
        """A variable equal to max(x, floor) in every solution (a binary picks the larger); x an
        affine expression of the model, at least 0 and at most its horizon."""
        lp = self.lp
        v = _variable(lp, name, floor, None)
        y = _variable(lp, f"{name}_y", 0, 1, pulp.LpBinary)  # 1: the floor is the larger
        big = self.horizon + floor
        lp += v >= x
        lp += v <= x + big * y
        lp += v <= floor + big * (1 - y)
        at = _warm_value(x, self.warm_start)
        self.warm_start[v.name], self.warm_start[y.name] = max(at, floor), 1.0 if floor > at else 0.0
        self.binaries += 1
        return v

    def add_recompute_variables(self) -> None:
        """x per (stage, microbatch, recompute pass offered) and g, what it moves from the F to
        its slot, per (stage, microbatch); the given schedule's choice as the warm start."""
        lp, m = self.lp, self.problem.num_microbatches
        self.x, self.g, self.gmax = {}, {}, {}
        for s, ops in self.offers.items():
            m_f = self.problem.cost.m_f[s]
            self.gmax[s] = max(0.0, *(m_f - self._offer(s, op).keep for op in ops))
            for j in range(m):
                for op in ops:
                    v = self.x[(s, j, op)] = _variable(lp, f"x{s}_{j}_{op.value}", 0, 1, pulp.LpBinary)
                    self.warm_start[v.name] = 1.0 if self.ckpt0.get((s, j)) is op else 0.0
                every = pulp.lpSum(self.x[(s, j, op)] for op in ops)
                lp += (every == 1) if self.problem.recompute == "full" else (every <= 1)
                self.g[(s, j)] = pulp.lpSum((m_f - self._offer(s, op).keep) * self.x[(s, j, op)] for op in ops)

    def _product(self, b1, b2, name: str):
        """A variable equal to the product of binaries b1 and b2 (in every integer solution)."""
        y = _variable(self.lp, name, 0, 1)
        self.lp += y <= b1
        self.lp += y <= b2
        self.lp += y >= b1 + b2 - 1
        self.warm_start[name] = self.warm_start[b1.name] * self.warm_start[b2.name]
        return y

    def add_chains(self, r: int) -> dict[PassType, list[int]]:
        chains: dict[PassType, list[int]] = {}
        for i in range(self.begin[r], self.stop[r]):
            chains.setdefault(_chain(self.rows[r][i]), []).append(i)
        lp, start, c = self.lp, self.start, self.problem.cost
        for key, ids in chains.items():
            self.chain_position.update(((r, i), pos) for pos, i in enumerate(ids))
            if self.fifo_chain(key):
                for i0, i1 in zip(ids, ids[1:]):
                    lp += start[(r, i1)] >= start[(r, i0)] + self.duration((r, i0))
                continue
            # split W passes in microbatch order: a pair where either is fused is free
            s, tw = key[0], c.t_w[key[0]]
            by_mb = sorted(ids, key=lambda i: self.rows[r][i].mb)
            for n, i0 in enumerate(by_mb):
                for i1 in by_mb[n + 1:]:
                    j0, j1 = self.rows[r][i0].mb, self.rows[r][i1].mb
                    big = max(0.0, self.latest_end[(r, i0)] + tw - self.earliest[(r, i1)])
                    lp += start[(r, i1)] >= start[(r, i0)] + tw - big * (self.u[(s, j0)] + self.u[(s, j1)])
        return chains

    def fifo_chain(self, chain: PassType) -> bool:
        return not (chain[1] is Op.W and chain[0] in self.choice)

    def own_memory(self, r: int, ids: list[int], pos: int):
        x = self.rows[r][ids[pos]]
        own = super().own_memory(r, ids, pos) + self._moved_sum(r, ids[:pos])
        if x.stage not in self.choice:
            return own
        u = self.u[(x.stage, x.mb)]
        if x.op is Op.B:  # fused, its W's memory changes at the same instant
            return own + self.problem.cost.m_w[x.stage] * u
        if x.op is Op.W:  # (an allocating W) the earlier split ones before it; fewer counted is a relaxation
            earlier = sum(1 for i in ids if self.rows[r][i].mb < x.mb)
            return earlier * self.memory_delta(r, ids[pos]) * (1 - u)
        return own

    def _moved_sum(self, r: int, ids: list[int]):
        """What recomputation moves, summed over passes surely before: taken from an F, given to its slot."""
        out = 0.0
        for i in ids:
            g = self.moved(r, i)
            if g is not None:
                out = out + (g if self.rows[r][i].op is Op.R else -g)
        return out

    def allocates(self, r: int, i: int) -> bool:
        return self.memory_delta(r, i) > 0 or self.moved(r, i) is not None

    def weighted_delta(self, r: int, k: int, w, name: str):
        """Pass k's memory change if it runs before (weight w, 1 or an order binary); with a
        recomputation choice and an order binary, g * w is a product: an F subtracts g (so the
        product must not exceed g or w's bound), a slot adds it (so it must reach g when w is 1)."""
        base = self.memory_delta(r, k) * w
        g = self.moved(r, k)
        if g is None:
            return base
        if isinstance(w, int):
            return base + (g if self.rows[r][k].op is Op.R else -g) * w
        x, big = self.rows[r][k], self.gmax[self.rows[r][k].stage]
        z = _variable(self.lp, name, 0, big)
        if x.op is Op.R:
            self.lp += z >= g - big * (1 - w)
            return base + z
        self.lp += z <= g
        self.lp += z <= big * w
        return base - z

    def add_memory(self, r: int, chains: dict[PassType, list[int]], allowed: float) -> None:
        """As the window's, with deltas that depend on the recomputation choice (``weighted_delta``)."""
        if not self.offers:
            return super().add_memory(r, chains, allowed)
        for ids in chains.values():
            for pos, i in enumerate(ids):
                if not self.allocates(r, i):
                    continue
                expr = pulp.lpSum(self.weighted_delta(r, k, w, f"z{r}_{k}_{i}_{n}")
                                  for n, (k, w) in enumerate(self.before[r][i]))
                own = self.moved(r, i)
                mine = self.memory_delta(r, i) + (0.0 if own is None else own if self.rows[r][i].op is Op.R else -own)
                self.lp += expr + self.own_memory(r, ids, pos) + mine <= allowed

    def decode(self) -> list[list[Action]]:
        """Per rank, the passes that run (a fused W and an unused recompute slot do not) in the
        model's order, each fused backward as one BW and each slot used as its recompute pass."""
        fused = {k for k, v in self.u.items() if round(pulp.value(v)) == 1}
        redo = {(s, j): op for (s, j, op), v in self.x.items() if round(pulp.value(v)) == 1}
        self.run_as = (fused, redo)
        out = []
        for r, row in enumerate(self.rows):
            here = {i for i, x in enumerate(row) if not (x.op is Op.W and (x.stage, x.mb) in fused)
                    and not (x.op is Op.R and (x.stage, x.mb) not in redo)}
            pos = {}
            for i in here:
                x = row[i]
                if (x.op is Op.W and x.stage in self.choice) or x.op is Op.R:
                    own = sum(1 for k in here if row[k].op is x.op and row[k].stage == x.stage and row[k].mb < x.mb)
                else:
                    own = self.chain_position[(r, i)]
                pos[i] = own + sum(w if isinstance(w, int) else round(pulp.value(w))
                                   for k, w in self.before[r][i] if k in here)
            out.append([_decoded(row[i], fused, redo) for i in sorted(here, key=lambda i: pos[i])])
        return out


def _warm_value(x, warm: dict[str, float]) -> float:
    """The value of a number, variable or affine expression of the model at the warm start."""
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, pulp.LpVariable):
        return warm.get(x.name, 0.0)
    return sum(coef * warm.get(v.name, 0.0) for v, coef in x.items()) + x.constant


def _decoded(x: Action, fused: set[tuple[int, int]], redo: dict[tuple[int, int], Op]) -> Action:
    """Action x of the model's rows as it runs: a fused B as its BW, a recompute slot as its pass."""
    if x.op is Op.B and (x.stage, x.mb) in fused:
        return Action(x.stage, Op.BW, x.mb)
    if x.op is Op.R:
        return Action(x.stage, redo[(x.stage, x.mb)], x.mb)
    return x


def _fifo(problem: Problem, rows: list[list[Action]]) -> list[list[Action]]:
    """``rows`` with each chain (``_chain``) in microbatch order, the orders the exact model
    ranges over: a stage's forwards, its backwards (B or BW, each position keeping its kind), its
    recompute passes (R or RS, taking the recomputed microbatches in order) and its split W
    passes (taking the split microbatches in order); the sequential schedule if that order
    deadlocks, overflows memory or puts a recompute pass after its backward."""
    out = []
    for row in rows:
        mbs: dict[PassType, list[int]] = {}
        for x in row:
            mbs.setdefault(_slot_chain(x), []).append(x.mb)
        nxt = {key: iter(sorted(v)) for key, v in mbs.items() if key[1] is not Op.W}
        relabelled: list[Action | None] = []
        split: dict[int, list[int]] = {}  # stage -> the microbatches its B passes now take
        for x in row:
            if x.op is Op.W:
                relabelled.append(None)
                continue
            j = next(nxt[_slot_chain(x)])
            if x.op is Op.B:
                split.setdefault(x.stage, []).append(j)
            relabelled.append(Action(x.stage, x.op, j))
        w_next = {s: iter(sorted(v)) for s, v in split.items()}
        out.append([a if a is not None else Action(x.stage, Op.W, next(w_next[x.stage])) for a, x in zip(relabelled, row)])
    if out == rows:
        return rows
    try:
        if _recomputes_in_place(out) and problem.fits(problem.evaluate(out)[1]):
            return out
    except Deadlock:
        pass
    return sequential_schedule(problem)


def _slot_chain(x: Action) -> PassType:
    """``_chain``, with both recompute passes of a stage in one chain (the exact model's slots)."""
    return (x.stage, Op.R) if x.op in RECOMPUTES else _chain(x)


def _recomputes_in_place(rows: list[list[Action]]) -> bool:
    """Whether each recompute pass comes after its F and before its backward on its rank."""
    for row in rows:
        at = {(x.stage, Op.B if x.op is Op.BW else x.op, x.mb): i for i, x in enumerate(row)}
        if any(x.op in RECOMPUTES and not at[(x.stage, Op.F, x.mb)] < i < at[(x.stage, Op.B, x.mb)]
               for i, x in enumerate(row)):
            return False
    return True


def _split(rows: list[list[Action]], stages: set[int] | None = None) -> list[list[Action]]:
    """``rows`` with each BW (on ``stages``; None: everywhere) run as its B then its W."""
    out = []
    for row in rows:
        new: list[Action] = []
        for x in row:
            if x.op is Op.BW and (stages is None or x.stage in stages):
                new += [Action(x.stage, Op.B, x.mb), Action(x.stage, Op.W, x.mb)]
            else:
                new.append(x)
        out.append(new)
    return out


def _choice_stages(cost: CostModel) -> set[int]:
    """The stages where fusing a backward may pay under ``cost``: ``CostModel.fuse_saves``, or
    where the passes hold all-to-all, a fused backward hiding more in an overlapped pair than its
    B does with its W after (``CostModel.fuse_pays_in_pair``)."""
    return {s for s in range(cost.num_stages) if cost.fuse_saves(s) or cost.fuse_pays_in_pair(s)}


def _model_form(tl: Timeline, offers: dict[int, tuple[Op, ...]]) -> Timeline:
    """``tl`` in the exact model's rows (``_ChoiceModel``): each BW as its B (the BW's times) then a
    W of no length at the BW's end; each recompute pass as the slot of its (stage, microbatch),
    and on the stages in ``offers`` a slot of no length for each microbatch not recomputed
    there, at the end of its F or of the stage's slot before it, whichever is later (the
    slots of a stage then run in microbatch order, each between its F and its backward)."""
    rows, start, end, memory = [], [], [], []
    for r, row in enumerate(tl.actions):
        new, s0, e0, m0 = [], [], [], []
        for i, x in enumerate(row):
            if x.op is Op.BW:
                new += [Action(x.stage, Op.B, x.mb), Action(x.stage, Op.W, x.mb)]
                s0 += [tl.start[r][i], tl.end[r][i]]
                e0 += [tl.end[r][i], tl.end[r][i]]
                m0 += [tl.memory[r][i], tl.memory[r][i]]
            else:
                new.append(Action(x.stage, Op.R, x.mb) if x.op in RECOMPUTES else x)
                s0.append(tl.start[r][i])
                e0.append(tl.end[r][i])
                m0.append(tl.memory[r][i])
        at = {(x.stage, x.op, x.mb): i for i, x in enumerate(new)}
        for s in sorted(set(offers) & {x.stage for x in new}):
            last = _NEG
            for j in sorted({x.mb for x in new if x.stage == s}):
                if (s, Op.R, j) in at:
                    last = e0[at[(s, Op.R, j)]]
                    continue
                t = max(e0[at[(s, Op.F, j)]], last)
                i = sum(e <= t for e in e0)
                new.insert(i, Action(s, Op.R, j))
                s0.insert(i, t)
                e0.insert(i, t)
                m0.insert(i, m0[i - 1])
                at = {(x.stage, x.op, x.mb): k for k, x in enumerate(new)}
                last = t
        rows.append(new)
        start.append(s0)
        end.append(e0)
        memory.append(m0)
    return Timeline(rows, start, end, memory, tl.busy, tl.reductions, tl.finish,  # the same lane
                    gathers=tl.gathers, begin=tl.begin)


def exact(problem: Problem, rows: list[list[Action]], time_limit: float, relaxed: bool = True,
          pairs: list[list[int]] | None = None) -> WindowResult | None:
    """The whole schedule as one window, with no band, over split, fused and mixed schedules
    and, where the costs offer recomputation, over every choice of it.

    ``relaxed``: every rank's start free, an exact model of the idle relaxation (see
    ``problem``), whose dual bound is a lower bound for every schedule, fused or split; its
    solution, re-simulated, may be worse than its objective (a rank the model starts late
    starts as early as it can). Otherwise: the best FIFO order under ASAP execution exactly
    (its bound holds for FIFO orders only).

    Where fusing may pay (``_choice_stages``) each backward there is fused or split as the
    model chooses, and where recomputation is offered each forward plain or checkpointed
    (``_ChoiceModel``); elsewhere a BW is split into B then W, which loses nothing (with
    all-to-all, fusing may pay in a pair alone: such stages are choice stages too). With
    recomputation FIFO orders are not known to lose nothing (``problem``): the model is a
    search over them and its dual bound no bound (``dual_bound`` is -inf).

    Where the passes hold all-to-all, the model also chooses overlapped pairs (``pairs``: those
    of ``rows``, the warm start): FIFO still loses nothing in the idle relaxation, since a pair
    is two passes in one time slot and what it costs depends on their stages, not on their
    microbatches, and with the fusing choice on what each pass's choice is, which relabelling
    keeps with the pass. A pair's backward is a B or a BW as the model fuses it, and its forward
    plain, fused or checkpointed (a recompute pass is never paired); its time is
    ``CostModel.pair_time`` of the two under the choices made (``_ChoiceModel.add_pair_durations``).
    With recomputation it is still no bound."""
    cost = problem.cost
    choice = _choice_stages(cost)
    offers = {s: ops for s in range(cost.num_stages) if (ops := cost.recompute_ops(s))}
    pairs = pairs if cost.has_all_to_all and pairs and any(pairs) else None
    split_stages = set(range(cost.num_stages)) - choice
    split = _split(rows, split_stages)
    pairs = _split_pairs(rows, pairs, split_stages) if pairs is not None else None
    rows = _fifo(problem, split)
    if pairs is not None and not _pairs_fit(rows, pairs):
        pairs = None  # (FIFO orders start from the sequential schedule)
    if pairs is not None:
        try:
            _, tl = problem.evaluate(rows, pairs)
        except Deadlock:  # relabelled to FIFO, a pair may wait for itself: then none
            pairs = None
    if pairs is None:
        _, tl = problem.evaluate(rows)
    if not choice and not offers:
        res = solve_window(problem, rows, tl, 0.0, _INF, _INF, time_limit, secondary=False, relaxed=relaxed, pairs=pairs)
    else:
        fused = {(x.stage, x.mb) for row in rows for x in row if x.op is Op.BW}
        redo = {(x.stage, x.mb): x.op for row in rows for x in row if x.op in RECOMPUTES}
        form = _model_form(tl, offers)
        model = _ChoiceModel(problem, form.actions, form, fused, choice, relaxed, redo, _form_pairs(rows, pairs, form.actions))
        res = model.solve(time_limit) if _build(model) else None
    if res is not None and not problem.fits_order(res.rows):
        # HiGHS's feasibility tolerance lets a memory row slip (a peak of 1.00000003 under 1.0):
        # keep the given order; the dual bound is still a bound
        res = replace(res, rows=rows, pairs=pairs)
    if res is not None and offers:
        res = replace(res, dual_bound=_NEG)
    return res


def _form_pairs(rows: list[list[Action]], pairs: list[list[int]] | None, form: list[list[Action]]) -> list[list[int]] | None:
    """``pairs`` of ``rows`` in the exact model's rows (``_model_form``): each where its forward
    now is, its backward (a BW now its B) right after it."""
    if pairs is None:
        return None
    out = []
    for row, at, new in zip(rows, pairs, form):
        where = {a: n for n, a in enumerate(new)}
        mine = []
        for i in at:
            f, b = row[i], row[i + 1]
            n = where[f]
            if n + 1 < len(new) and new[n + 1] == Action(b.stage, Op.B, b.mb):
                mine.append(n)
        out.append(mine)
    return out


def _pairs_fit(rows: list[list[Action]], pairs: list[list[int]]) -> bool:
    """Whether each pair of ``pairs`` is a forward and a backward of another microbatch in ``rows``."""
    return all(i + 1 < len(row) and row[i].op is Op.F and row[i + 1].op in (Op.B, Op.BW) and row[i].mb != row[i + 1].mb
               for row, at in zip(rows, pairs) for i in at)


def _split_pairs(rows: list[list[Action]], pairs: list[list[int]], stages: set[int]) -> list[list[int]]:
    """``pairs`` of ``rows`` where ``_split`` has run every BW on ``stages`` as its B then its W:
    a pair's forward moves down by one per such BW before it."""
    out = []
    for row, at in zip(rows, pairs):
        shift, k, moved = 0, 0, []
        for i in sorted(at):
            while k < i:
                shift += row[k].op is Op.BW and row[k].stage in stages
                k += 1
            moved.append(i + shift)
        out.append(moved)
    return out


def _build(model: _WindowModel) -> bool:
    """Build the model's rows; False if its time bounds contradict (cannot happen for a
    consistent timeline)."""
    if not model.time_bounds():
        return False
    model.add_variables()
    model.add_objective()
    model.add_precedence()
    model.add_lane()
    model.add_order_and_memory()
    return True


@dataclass
class ImproveStats:
    """What the window search did: windows solved, improvements kept, the largest model, and whether it converged."""
    windows: int = 0
    improved: int = 0
    binaries: int = 0
    converged: bool = False  # a sweep with windows as long as the schedule, each solved, found nothing more


def improve(
    problem: Problem,
    rows: list[list[Action]],
    deadline: float,
    on_step=None,
    target: float = _NEG,
) -> tuple[list[list[Action]], ImproveStats]:
    """Large-neighbourhood search: sweep windows over the schedule until ``deadline``
    (``deadline.now()``), keeping each re-optimised window that the simulator confirms is
    better. Windows grow after a sweep without improvement; a window that hits its time
    limit makes the next ones smaller. Stops as soon as the objective reaches ``target``
    (a lower bound: nothing better exists). No overlapped pairs (``improve_paired`` chooses them)."""
    rows, _, stats = improve_paired(problem, rows, None, deadline, on_step, target, paired=False)
    return rows, stats


def improve_paired(
    problem: Problem,
    rows: list[list[Action]],
    pairs: list[list[int]] | None,
    deadline: float,
    on_step=None,
    target: float = _NEG,
    paired: bool = True,
) -> tuple[list[list[Action]], list[list[int]] | None, ImproveStats]:
    """``improve`` from ``rows`` with overlapped ``pairs`` (None: none), each window choosing
    its pairs where the passes hold all-to-all and ``paired`` (those outside it stay): the
    rows, their pairs (None: none) and what the search did."""
    c = problem.cost
    tick = clock.now()
    value, tl = problem.evaluate(rows, pairs)
    # Each window also costs a pass over the schedule to build and one to simulate: keep
    # time for them so the deadline holds at p=32, m=256 too.
    overhead = 3 * (clock.now() - tick) + 0.05
    score = (value, sum(tl.iteration))
    unit = max(c.t_f[s] + c.t_b[s] + c.t_w[s] for s in range(c.num_stages)) * (c.num_stages // c.num_ranks)
    length = 2.0 * unit
    stats = ImproveStats()

    def time_left() -> bool:
        return clock.now() < deadline - 2 * overhead and score[0] > target

    while time_left():
        horizon = max(e[-1] for e in tl.end if e)
        step = length / 2
        swept_better = swept_cut = False  # (cut: a window stopped at its own time limit)
        t1 = 0.0
        while t1 < horizon and time_left():
            left = deadline - clock.now() - overhead
            res = solve_window(problem, rows, tl, t1, t1 + length, length, min(left, 2.0 + length / unit), pairs=pairs,
                               paired=paired)
            stats.windows += 1
            if res is not None:
                stats.binaries = max(stats.binaries, res.binaries)
                try:
                    v2, tl2 = problem.evaluate(res.rows, res.pairs)
                except Deadlock:  # (a decoding the model's tolerances let slip: cannot win)
                    v2, tl2 = _INF, tl
                new = (v2, sum(tl2.iteration))
                better = new[0] < score[0] * (1 - REL_TOL) or (new[0] <= score[0] and new[1] < score[1] * (1 - REL_TOL))
                if better and problem.fits(tl2):
                    rows, pairs, tl, score = res.rows, res.pairs, tl2, new
                    stats.improved += 1
                    swept_better = True
                    horizon = max(e[-1] for e in tl.end if e)
                if not res.optimal:
                    swept_cut = True
                    length = max(unit, length / 1.5)
            if on_step is not None:
                on_step(score[0], stats)
            t1 += step
        if t1 < horizon or score[0] <= target:
            break  # out of time mid-sweep, or optimal
        if not swept_better:
            if length >= horizon and not swept_cut:
                stats.converged = True
                break
            length *= 1.5
    if score[0] <= target:
        stats.converged = True  # optimal: the target is a lower bound
    return rows, pairs, stats
