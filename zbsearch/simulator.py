"""Simulator: the timeline a schedule produces under a cost model.

Each rank executes its list strictly in order; an action starts as soon as the previous
action on its rank has finished and every pass it depends on has finished (plus the
communication delay when that pass ran on another rank). Communication is modelled as a
latency that does not occupy either rank, which is what asynchronous P2P achieves when
transfers overlap compute. An action takes what ``CostModel.durations`` gives it (the F of a
microbatch whose backward its rank runs fused takes t_ff, not t_f; that of a microbatch it
recomputes the checkpointed forward's time). An overlapped pair (a forward and the backward
after it, ``overlapped``) starts when its rank is free and the inputs of both passes have
arrived, and both passes end together, ``CostModel.pair_time`` later; a pair whose backward
waits for its own forward (directly or through other ranks) can never start: a deadlock, which
the validator names. Memory on a rank changes only through its own
actions (``CostModel.memory_deltas``), so the memory curve depends on the order alone, not on
timing.

Bubble rate generalises the paper's (span - m(T_F+T_B+T_W)) / span to unequal stages as
(T - max_r busy_r) / T with T = max_r span_r: the time the slowest rank's period exceeds the
compute of the busiest rank, the part of the iteration a schedule can remove. It equals the
paper's formula when stages are uniform. A rank's busy time counts its F, B and W passes, not
its recompute passes: recomputation is work a schedule with more memory would not do, so the
bubble rate counts it with the idle time. An overlapped pair counts as the time it holds the
rank (``pair_time``): what it hides is time the rank does not spend.

Where a stage's reduction or gather slows its rank's passes while it runs (``CostModel.slowdown``,
the rule in ``zbsearch.reductions``), a pass beside the lane ends later than its time alone;
busy time still counts its time alone, so the slowdown counts with the idle time. The lane is
the runs the simulator queued while timing the passes (the timeline's ``reductions`` and
``gathers``). Where lanes of different ranks share a link (``CostModel.shares_lanes``) a rank's
lane depends on the others', and where a run slows while its rank computes
(``CostModel.stretch``) on the timing of the rank's passes (``CostModel.couples_lanes``):
the simulator then advances every rank's passes and lanes together in time, event by event,
instead of one pass in dependency order. Both ways an action may start
by the same rule (``ready_at``); they differ only in when the lane's gathers end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import clock
from .actions import RECOMPUTES, Action, Op
from .costs import CostModel
from .dependencies import action_predecessor_types, edge_delay, pass_positions
from .errors import ZbError
from .reductions import (
    Reduction,
    SharedLanes,
    Slowing,
    first_passes,
    gather_ends,
    gather_releases,
    iteration_end,
    lane_next,
    last_backward,
    slowed_end,
    step_start,
)

__all__ = ["Timeline", "Deadlock", "simulate", "memory_trace", "peak_memory", "bubble_rate"]


class Deadlock(ZbError):
    """No rank can proceed. ``waits``: (rank, its next action, the action it waits for, that rank)."""

    def __init__(self, waits: list[tuple[int, Action, Action, int]]):
        self.waits = waits
        super().__init__("deadlock: " + "; ".join(f"rank {r} waits at {a} for {b} (rank {q})" for r, a, b, q in waits))


@dataclass(frozen=True)
class Timeline:
    """When each action of a schedule runs and what memory each rank holds, as ``simulate`` finds.

    ``start[r][i]`` and ``end[r][i]`` (ms) are those of rank r's i-th action, ``memory[r][i]``
    the activation memory the rank holds after it, ``busy[r]`` the rank's compute time in F, B
    and W passes (recompute passes not counted, an overlapped pair counted once as the time it
    takes; see the module), ``overlapped[r]`` the positions of rank r's pairs (empty: none). Where the costs end the
    iteration with reductions (``zbsearch.reductions``), ``reductions[r]`` holds rank r's
    (stage, start, end) and ``finish[r]`` when its iteration ends, optimizer steps included;
    where sharded stages gather their parameters first, ``gathers[r]`` holds those and
    ``begin[r]`` the start of rank r's step, which its iteration counts from.
    """

    actions: list[list[Action]]
    start: list[list[float]]
    end: list[list[float]]
    memory: list[list[float]]  # memory on the rank after each action
    busy: list[float]
    reductions: list[list[Reduction]] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    overlapped: list[list[int]] = field(default_factory=list)
    gathers: list[list[Reduction]] = field(default_factory=list)  # per rank, where stages gather (sharded)
    begin: list[float] = field(default_factory=list)  # per rank, its step's start where it gathers

    def __repr__(self) -> str:
        if not self.actions:
            return "Timeline(ranks=0)"
        return (f"Timeline(ranks={self.num_ranks}, actions={sum(map(len, self.actions))}, span={max(self.span):.4g} ms, "
                f"bubble={self.bubble_rate:.2%}, peak_memory={max(self.peak_memory):.4g})")

    @property
    def num_ranks(self) -> int:
        """Ranks in the schedule."""
        return len(self.actions)

    @property
    def span(self) -> list[float]:
        """Per rank, its first action's start to its last action's end (ms): with no barrier
        between iterations, the longest is the iteration period."""
        return [(e[-1] - s[0]) if s else 0.0 for s, e in zip(self.start, self.end)]

    @property
    def iteration(self) -> list[float]:
        """Per rank, its first action's start to the end of its iteration (ms): its span, or
        where the iteration ends with reductions, its last reduction or pass plus its optimizer
        steps. The longest is the iteration period."""
        if not self.finish:
            return self.span
        if self.begin:
            return [f - b for b, f in zip(self.begin, self.finish)]
        return [(f - s[0]) if s else f for s, f in zip(self.start, self.finish)]

    @property
    def period(self) -> float:
        """The iteration period: the longest per-rank iteration (ms)."""
        return max(self.iteration, default=0.0)

    @property
    def makespan(self) -> float:
        """The first start on any rank to the last end on any rank (ms)."""
        ends = [e[-1] for e in self.end if e]
        starts = [s[0] for s in self.start if s]
        return max(ends) - min(starts) if ends else 0.0

    @property
    def peak_memory(self) -> list[float]:
        """Per rank, the most activation memory it holds."""
        return peak_memory(self.memory)

    @property
    def bubble_rate(self) -> float:
        """The share of the longest span that the busiest rank does not compute (see the module)."""
        return bubble_rate(max(self.span), max(self.busy))

    def bubble_rate_makespan(self) -> float:
        """The bubble rate with the makespan as the period (a barrier between iterations)."""
        return bubble_rate(self.makespan, max(self.busy))


def bubble_rate(period: float, busiest: float) -> float:
    """``(period - busiest) / period``: the share of an iteration the busiest rank waits (0 for an
    empty period)."""
    return (period - busiest) / period if period > 0 else 0.0


def simulate(rank_actions: list[list[Action]], cost: CostModel, overlapped: list[list[int]] | None = None) -> Timeline:
    """Timeline of ``rank_actions``, with ``overlapped[r]`` the positions on rank r where a forward
    and the backward after it run as one pair (``Schedule.overlapped``; None: no pairs); raises
    ZbError on a missing dependency or a deadlock.

    One pass in dependency order: each rank runs until its next action waits for a pass not
    run yet, then parks on the rank that owes the pass and is woken when that rank stops
    (blocked or done) past it. Every action is timed once, after everything it waits for, so
    the times are those of any topological order; the ranks left parked at the end are exactly
    those a round-robin sweep would leave stuck, and report the same waits."""
    clock.simulated(sum(map(len, rank_actions)))  # the work clock counts simulated passes
    S = cost.num_stages
    where = pass_positions(rank_actions, S)
    # per op, per stage: ((positions of the pass it waits for, by microbatch), edge delay), ...
    kinds = {
        op: [tuple((where[dop][ds], edge_delay(cost, ds, s)) for ds, dop in action_predecessor_types(s, op, S)) for s in range(S)]
        for op in Op
    }
    durations = cost.durations(rank_actions)
    pairs = pair_times(rank_actions, durations, cost, overlapped)
    ran: _Lanes | _Ran | None = None
    if cost.couples_lanes:
        start, end, done, ran = _simulate_shared(rank_actions, cost, kinds, durations, pairs)
    else:
        ran = _Lanes(rank_actions, cost) if cost.has_reductions or cost.t_gather else None
        start, end, done = _simulate_alone(rank_actions, cost, kinds, durations, pairs, ran)
    if any(d < len(row) for d, row in zip(done, rank_actions)):
        raise Deadlock(_waits(rank_actions, done, _resolve(rank_actions, where, S), overlapped))

    busy = [sum(d for a, d in zip(row, dur) if a.op not in RECOMPUTES) for row, dur in zip(rank_actions, durations)]
    for r, row_pairs in enumerate(pairs):  # a pair holds its rank for its pair time, not the sum of its passes
        busy[r] -= sum(durations[r][i] + durations[r][i + 1] - t for i, t in row_pairs.items())
    reductions, finish, gathered, begin = [], [], [], []
    if ran is not None and cost.has_reductions:
        reductions = ran.reduced
        finish = [iteration_end(row, ends, got, cost.t_opt) for row, ends, got in zip(rank_actions, end, reductions)]
    if ran is not None and cost.t_gather:
        gathered = [[(s, a, b) for s, a, b in got if b > a] for got in ran.gathered]
        begin = [step_start(row, starts, {s: b for s, _, b in got})
                 for row, starts, got in zip(rank_actions, start, ran.gathered)]
    return Timeline(rank_actions, start, end, memory_trace(rank_actions, cost), busy, reductions, finish,
                    overlapped=[list(p) for p in pairs] if pairs else [], gathers=gathered, begin=begin)


def _simulate_alone(rank_actions, cost, kinds, durations, pairs, slow: _Lanes | None):
    """Start and end of every action, each lane alone on its link (``simulate``): one pass in
    dependency order; the number of actions each rank ran (short of its list: a deadlock)."""
    R = len(rank_actions)
    release = _releases(rank_actions, cost)
    start = [[0.0] * len(row) for row in rank_actions]
    end = [[0.0] * len(row) for row in rank_actions]
    done = [0] * R  # number of actions finished per rank
    free = [0.0] * R
    parked: list[list[tuple[int, int]]] = [[] for _ in range(R)]  # per rank q: (position on q, waiting rank)
    runnable = list(range(R - 1, -1, -1))
    while runnable:
        r = runnable.pop()
        row, row_start, row_end, row_dur, row_release = rank_actions[r], start[r], end[r], durations[r], release[r]
        row_pairs = pairs[r] if pairs else None
        n, i, t_free = len(row), done[r], free[r]
        wait: tuple[int, int] | None = None
        while i < n:
            together = row_pairs.get(i) if row_pairs else None  # an overlapped pair's time, or None
            t = ready_at(r, i, row, together is not None, t_free, row_release, kinds, end, done)
            if isinstance(t, tuple):
                wait = t
                break
            row_start[i] = t
            if together is None:
                t_free = row_end[i] = t + row_dur[i] if slow is None else slow.end(r, i, t, row_dur[i], 1)
                i += 1
            else:
                row_start[i + 1] = t
                t_free = row_end[i] = row_end[i + 1] = t + together if slow is None else slow.end(r, i, t, together, 2)
                i += 2
        done[r], free[r] = i, t_free
        if parked[r]:  # wake the ranks waiting for a pass this rank has now run
            still = []
            for di, q in parked[r]:
                if di < i:
                    runnable.append(q)
                else:
                    still.append((di, q))
            parked[r] = still
        if wait is not None:
            parked[wait[0]].append((wait[1], r))
    return start, end, done


def ready_at(r: int, i: int, row: list[Action], pair: bool, free: float, release: dict[int, float] | None,
             kinds, end: list[list[float]], done: list[int]) -> float | tuple[int, int]:
    """When rank r's next action, at position i of its list ``row``, may start (with the one after
    it where ``pair``: an overlapped pair waits for the inputs of both): the rule both engines of
    ``simulate`` time by. No earlier than its rank is free (``free``), than the release of a
    stage's first pass (``release``: position -> when the stage's gather ends on the rank's
    lane; inf while it has not ended), and than the end of each pass it waits for plus the
    edge's delay (``kinds``: ``simulate``'s table of those passes' positions; ``end``: the
    ends so far; ``done[q]``: how many actions rank q has run, the positions before i on rank r).

    A time, or the (rank, position) of a pass it waits for that has not run ((r, len(row)) where
    no rank runs it): a pair whose backward waits for its own forward waits for itself."""
    t = free
    if release:
        at = release.get(i)
        if at is not None and at > t:
            t = at
        if pair:
            at = release.get(i + 1)
            if at is not None and at > t:
                t = at
    for a in (row[i], row[i + 1]) if pair else (row[i],):
        for positions, delay in kinds[a.op][a.stage]:
            pos = positions[a.mb]
            if pos is None:
                return r, len(row)
            dr, di = pos
            if di >= (i if dr == r else done[dr]):
                return pos
            e = end[dr][di] + delay
            if e > t:
                t = e
    return t


class _Lanes:
    """Per rank, its lane alone on its link (``reductions.lane_next``), grown as its passes end:
    its gathers from the origin, one at a time in stage order (``reductions.gather_ends``), then
    each stage's reduction once its last W or BW has ended. Records the runs (``gathered``,
    ``reduced``: per rank, (stage, start, end)), which the timeline's lane is, and slows the
    passes beside those whose factor exceeds 1 (``reductions.slowed_end``)."""

    def __init__(self, rank_actions: list[list[Action]], cost: CostModel):
        self.t_reduce, self.slowdown = cost.t_reduce, cost.slowdown
        self.closing = [{i: s for s, i in last_backward(row).items()} for row in rank_actions]
        self.gathered: list[list[Reduction]] = []
        self.runs: list[list[Slowing]] = []  # per rank, the runs that slow its passes, in time order
        for row in rank_actions:
            ends = gather_ends({a.stage for a in row}, cost.t_gather) if cost.t_gather else {}
            self.gathered.append([(s, e - cost.t_gather[s], e) for s, e in ends.items()])
            self.runs.append([(a, b, self.factor(s)) for s, a, b in self.gathered[-1] if b > a and self.factor(s) > 1.0])
        self.reduced: list[list[Reduction]] = [[] for _ in rank_actions]
        self.free = [max([0.0, *(e for _, _, e in got)]) for got in self.gathered]  # when each rank's lane is free
        self.past = [0] * len(rank_actions)  # per rank, runs ended before its next pass can start

    def factor(self, s: int) -> float:
        """How much stage s's run on the lane slows the passes beside it."""
        return self.slowdown[s] if self.slowdown else 1.0

    def end(self, r: int, i: int, start: float, work: float, count: int) -> float:
        """The end of rank r's pass (or pair, ``count`` 2) at position i, started at ``start``
        with ``work`` ms alone; the reductions it makes ready join the lane."""
        runs = self.runs[r]
        if runs:
            k = self.past[r]
            while k < len(runs) and runs[k][1] <= start:
                k += 1
            self.past[r] = k
            end = slowed_end(start, work, runs, k)
        else:
            end = start + work
        closing = self.closing[r]
        for j in range(i, i + count):
            s = closing.get(j)
            if s is not None:
                a, self.free[r] = lane_next(self.free[r], end, self.t_reduce[s])
                self.reduced[r].append((s, a, self.free[r]))
                if self.free[r] > a and self.factor(s) > 1.0:
                    runs.append((a, self.free[r], self.factor(s)))
        return end


def _simulate_shared(rank_actions, cost: CostModel, kinds, durations, pairs):
    """``simulate`` where a rank's lane depends on the timing of passes (``CostModel.couples_lanes``:
    lanes of different ranks share links, or runs slow beside their rank's passes): every rank's
    passes and lanes advanced together in time, event by event, the lanes by
    ``reductions.SharedLanes`` (each run at 1/its ``stretch`` while its rank has a pass
    under way) and each pass at 1/factor of its speed while its rank's lane runs a run whose
    factor exceeds 1. Start and end of every action, the number each rank ran (short of its
    list: a deadlock) and the lanes' runs (``gathered``, ``reduced``)."""
    R = len(rank_actions)
    lanes = SharedLanes(cost.lane_link or range(R), cost.lane_share)
    slowdown = cost.slowdown
    stretch = cost.stretch or (1.0,) * cost.num_stages
    closing = [{i: s for s, i in last_backward(row).items()} for row in rank_actions]
    # per rank, position of each stage's first pass -> the end of the stage's gather (inf until the lane has run it)
    release: list[dict[int, float]] = [{} for _ in rank_actions]
    firsts = [first_passes(row) if cost.t_gather else {} for row in rank_actions]
    for r, first in enumerate(firsts):
        for s in sorted(first):
            lanes.add(r, cost.t_gather[s], (False, s), stretch[s])
            release[r][first[s]] = float("inf")
    gathered = [0] * R  # per rank, the gathers it has noted
    start = [[0.0] * len(row) for row in rank_actions]
    end = [[0.0] * len(row) for row in rank_actions]
    done, free = [0] * R, [0.0] * R
    running: list[list[float] | None] = [None] * R  # per rank, [count, ms left alone] of its pass under way
    t = 0.0

    def factor(r: int) -> float:  # the slowdown of rank r's passes now
        tag = lanes.running(r)
        return slowdown[tag[1]] if tag is not None and slowdown else 1.0

    def note_gathers() -> None:  # the ends of the gathers run so far: the lanes run them first
        for r, runs in enumerate(lanes.runs):
            for (is_reduction, s), _, b in runs[gathered[r]:] if cost.t_gather else ():
                if is_reduction:
                    break
                release[r][firsts[r][s]] = b
                gathered[r] += 1

    while True:
        note_gathers()
        soon = float("inf")
        for r in range(R):  # start what can start now
            if running[r] is None and done[r] < len(rank_actions[r]):
                i = done[r]
                together = pairs[r].get(i) if pairs else None
                at = ready_at(r, i, rank_actions[r], together is not None, free[r], release[r], kinds, end, done)
                if isinstance(at, tuple):  # it waits for a pass not run yet
                    continue
                if at > t:
                    soon = min(soon, at)
                    continue
                start[r][i] = at
                if together is None:
                    running[r] = [1, durations[r][i]]
                else:
                    start[r][i + 1] = at
                    running[r] = [2, together]
        for r in range(R):
            job = running[r]
            lanes.computing[r] = job is not None  # a rank's lane runs slower while it computes
            if job is not None:
                soon = min(soon, t + job[1] * factor(r))
        soon = min(soon, lanes.next_end())
        if soon == float("inf"):
            break
        step = soon - t
        for r in range(R):
            job = running[r]
            if job is not None:
                job[1] -= step / factor(r)
        lanes.advance(soon)
        t = soon
        for r in range(R):
            job = running[r]
            if job is not None and job[1] <= 1e-9 * max(1.0, t):
                i, count = done[r], int(job[0])
                for j in range(i, i + count):
                    end[r][j] = t
                    closes = closing[r].get(j)
                    if closes is not None:
                        lanes.add(r, cost.t_reduce[closes], (True, closes), stretch[closes])
                free[r], done[r], running[r] = t, i + count, None
    lanes.computing = [False] * R
    lanes.advance(float("inf"))
    note_gathers()
    ran = _Ran([[(s, a, b) for (is_reduction, s), a, b in runs if not is_reduction] for runs in lanes.runs],
               [[(s, a, b) for (is_reduction, s), a, b in runs if is_reduction] for runs in lanes.runs])
    return start, end, done, ran


@dataclass
class _Ran:
    """The lanes' runs of a simulation: per rank, its gathers and its reductions (stage, start, end)."""

    gathered: list[list[Reduction]]
    reduced: list[list[Reduction]]


def pair_times(rank_actions: list[list[Action]], durations: list[list[float]], cost: CostModel,
               overlapped: list[list[int]] | None) -> list[dict[int, float]]:
    """Per rank, position of each overlapped pair's forward -> the pair's time (``CostModel.pair_time``
    of the two passes as ``durations`` prices them); empty where there are no pairs."""
    if not overlapped or not any(overlapped):
        return []
    return [{i: cost.pair_time(row[i], row[i + 1], dur[i], dur[i + 1]) for i in at}
            for row, dur, at in zip(rank_actions, durations, overlapped)]


def _releases(rank_actions: list[list[Action]], cost: CostModel) -> list[dict[int, float]]:
    """Per rank, position -> the earliest start of the first pass of each stage whose parameters
    the rank gathers first (``reductions.gather_releases``); empty without gathers."""
    return [gather_releases(row, cost.t_gather) for row in rank_actions]


def memory_trace(rank_actions: list[list[Action]], cost: CostModel) -> list[list[float]]:
    """Memory on each rank after each of its actions (``Timeline.memory``): it depends on the
    order alone, so it needs no timing, and no check that the order can run."""
    memory = []
    for deltas in cost.memory_deltas(rank_actions):
        cur, trace = 0.0, []
        for d in deltas:
            cur += d
            trace.append(cur)
        memory.append(trace)
    return memory


def peak_memory(memory: list[list[float]]) -> list[float]:
    """Per rank, the most memory it holds (``Timeline.peak_memory``; nothing held counts as 0)."""
    return [max([0.0, *m]) for m in memory]


def _resolve(rank_actions: list[list[Action]], where, S: int) -> list[list[list[tuple[int, int]]]]:
    """Per action, (rank, position) of each pass it waits for, in the order of
    ``action_predecessor_types``, from ``simulate``'s ``pass_positions`` table; ZbError on the
    first pass (in rank and position order) that no rank executes. Only for a schedule that did
    not run through: to say why."""
    deps = []
    for r, row in enumerate(rank_actions):
        row_deps = []
        for a in row:
            resolved = []
            for ds, dop in action_predecessor_types(a.stage, a.op, S):
                pos = where[dop][ds][a.mb]
                if pos is None:
                    raise ZbError(f"{a} on rank {r} depends on {ds}{dop.value}{a.mb}, which no rank executes")
                resolved.append(pos)
            row_deps.append(resolved)
        deps.append(row_deps)
    return deps


def _waits(rank_actions, done, deps, overlapped) -> list[tuple[int, Action, Action, int]]:
    waits = []
    for r, row in enumerate(rank_actions):
        if done[r] < len(row):
            i = done[r]
            waiting = deps[r][i] + (deps[r][i + 1] if overlapped and i in overlapped[r] else [])
            blocker = next(((dr, di) for dr, di in waiting if di >= done[dr]), None)
            if blocker is not None:
                dr, di = blocker
                waits.append((r, row[done[r]], rank_actions[dr][di], dr))
    return waits
