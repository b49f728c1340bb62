"""Local search over per-rank orders, judged by ASAP re-simulation: reaches non-FIFO optima.

Why: the exact MILP and its windows range over FIFO orders (each stage takes its microbatches
in order), and for ``span`` the best order may not be FIFO (``problem``): a rank that takes a
later microbatch first starts later and can finish with a shorter span. The MILP's solutions
are also judged by its own model, which may differ from the ASAP timeline. This search makes
no such assumption: a move takes one pass on a rank and reinserts it elsewhere on that rank
(an adjacent swap is the shortest move; exchanging two microbatches on a stage, or moving a W
into a gap, are longer ones), and every candidate is timed by ASAP simulation.

* Moves that break the rank's own dependencies (a pass before its predecessor on the same
  rank) or its memory limit are never simulated; memory is checked from the rank's prefix
  sums, deadlocks across ranks are found by the simulation.
* A move is kept when it lowers the objective, or keeps it and lowers the sum of the ranks'
  spans (for the iteration, of their iterations: a plateau move that makes room). Descent is first-improvement in random order; at
  a local optimum a few random valid moves perturb the best schedule (iterated local search),
  more of them the longer no better schedule turns up.
* Candidates are timed by a small simulator on integer pass ids (the core simulator's rule,
  without its bookkeeping: 5 to 10 times faster on 36 to 768 passes); the result is re-simulated by the core
  simulator (``Problem.evaluate``) and returned only if it is valid, within the limit and no
  worse than the input, so a discrepancy could cost quality, never correctness. The small
  simulator runs passes and lanes at full speed (no slowdown beside a reduction, no reduction
  slowed beside a pass, no sharing of links); the core simulator prices all three.
* Where fusing a backward may pay (a BW cheaper than B + W, an F before it cheaper than t_f,
  or a memory peak a BW avoids), a move also toggles one microbatch's backward on one stage:
  fuse its B and W into one BW where its B runs, or split a BW into B there and a W placed
  anywhere later on the rank. Its F then costs t_ff or t_f, as ``CostModel.durations`` says.
  So the search ranges over split, fused and mixed schedules: it fuses where that pays and
  splits where a W fills a bubble.
* Where the problem allows recomputation ("auto"), a move also toggles one microbatch's
  recomputation on one stage: insert its recompute pass (R, or RS where offered) anywhere
  between its F and its backward, take it out, or trade one for the other in place. Its F then
  costs and keeps what a checkpointed forward does. Recompute passes move like any other pass,
  within their F and their backward. With "full" every forward stays recomputed.
* Where the passes hold all-to-all (``CostModel.has_all_to_all``) and the caller takes pairs
  (``local_search_paired``), a move also pairs a forward with the backward of another
  microbatch right after it into one overlapped pair (``CostModel.pair_time``), pulls the
  next backward up to just after a forward and pairs them, or unpairs a pair; where a BW
  hides more in a pair than its B with its W after (``CostModel.fuse_pays_in_pair``), a move
  also fuses a backward and pairs it in one step (or splits one and unpairs it): a BW that pays
  only inside a pair is found though neither step pays alone. A move that
  separates a pair's passes unpairs it; a pair whose backward waits for its own forward
  deadlocks and is discarded.
* ``deadline`` (``deadline.now()``) is checked between simulations: an expired one returns the
  input unchanged.
"""

from __future__ import annotations

import random

from .. import clock
from ..actions import RECOMPUTES, Action, Op
from ..dependencies import edge_delay, must_precede, predecessors
from ..limits import allowance
from ..reductions import lane_runs
from ..tolerances import REL_TOL
from .problem import Problem

__all__ = ["local_search", "local_search_paired"]

_OPS = (Op.F, Op.B, Op.W)
# which backwards are fused, which forwards are checkpointed for which recompute pass
State = tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int, Op]]]
_PLAIN: State = (frozenset(), frozenset())
Pairs = frozenset[int]  # the forwards (ids) that run as one overlapped pair with the backward after them
_NONE: Pairs = frozenset()


class _Model:
    """The problem on integer pass ids: durations, inputs with delays, memory deltas and, per
    pass, the passes of its own rank it must follow or precede. Each (stage, microbatch) has an
    F, a backward (its B, or its BW when fused: one id either way, so that what depends on the
    backward need not know which), a W (absent from the rows when fused) and a recompute pass
    per one offered (absent but where it is recomputed). Durations and memory deltas depend on
    which backwards are fused and which forwards checkpointed: ``costs`` gives them for a state."""

    def __init__(self, problem: Problem, pairing: bool = False) -> None:
        c, m, S = problem.cost, problem.num_microbatches, problem.cost.num_stages
        self.cost = c
        self.pairing = pairing and c.has_all_to_all
        ops = {s: (*_OPS, *c.recompute_ops(s)) for s in range(S)}
        self.actions = [Action(s, op, j) for s in range(S) for op in ops[s] for j in range(m)]
        self.id = {(a.stage, a.op, a.mb): k for k, a in enumerate(self.actions)}
        # split: each pass costs its type's time, as CostModel.durations prices a split schedule
        self.dur = [c.time(a.stage, a.op) for a in self.actions]
        self.mem = [c.memory(a.stage, a.op) for a in self.actions]
        self.deps = [
            [(self.id[d], edge_delay(c, d[0], a.stage)) for d in predecessors(a.stage, a.op, a.mb, S)]
            for a in self.actions
        ]
        rank = [c.stage_to_rank[a.stage] for a in self.actions]
        self.rank = rank
        self.before: list[frozenset[int]] = []  # same-rank passes that must run before pass k
        self.after: list[frozenset[int]] = []  # same-rank passes that must run after pass k
        for k, a in enumerate(self.actions):
            here = (a.stage, a.op)
            own = [((s, op), self.id[(s, op, a.mb)]) for s in c.rank_stages(rank[k]) for op in ops[s]]
            self.before.append(frozenset(x for t, x in own if must_precede(t, here, S)))
            self.after.append(frozenset(x for t, x in own if must_precede(here, t, S)))
        self.allowed = [allowance(x) for x in problem.limits()]
        self.span = problem.spans
        # the iteration: per rank, each of its stages' backward passes (B or BW, and W: the
        # last to end is the stage's last backward), the reduction after them, the optimizer steps
        self.lane: list[list[tuple[list[int], float]]] | None = None
        self.opt = [0.0] * c.num_ranks
        if problem.objective == "iteration" and c.has_reductions:
            self.lane = [[([k for k, a in enumerate(self.actions) if a.stage == s and a.op in (Op.B, Op.W)], c.t_reduce[s])
                          for s in c.rank_stages(r)] for r in range(c.num_ranks)]
            self.opt = [sum(c.t_opt[s] for s in c.rank_stages(r)) for r in range(c.num_ranks)]
        # stages where a backward may be fused or split (CostModel.fusing_may_pay, per stage;
        # with pairs, also where a BW hides more in a pair: CostModel.fuse_pays_in_pair)
        self.choice = frozenset(s for s in range(S) if c.fuse_saves(s) or (self.pairing and c.fuse_pays_in_pair(s)))
        # stages where a move may recompute or not (with "full", none: every forward is)
        self.recompute = {s: c.recompute_ops(s) for s in range(S)} if problem.recompute == "auto" else {}
        self.any_recompute = any(self.recompute.values())

    def costs(self, state: State) -> tuple[list[float], list[float]]:
        """(durations, memory deltas) by id when the backwards in ``state[0]`` are BW passes and
        the forwards in ``state[1]`` are checkpointed (a checkpointed F's price first)."""
        fused, ckpt = state
        if not fused and not ckpt:
            return self.dur, self.mem
        dur, mem, c, ident = list(self.dur), list(self.mem), self.cost, self.id
        for s, j in fused:
            dur[ident[(s, Op.F, j)]] = c.t_ff[s]
            for op in c.recompute_ops(s):  # its recompute pass, if any, as before a BW
                dur[ident[(s, op, j)]] = c.offer(s, op).time(fused=True)  # type: ignore[union-attr]
            dur[ident[(s, Op.B, j)]] = c.t_bw[s]
            mem[ident[(s, Op.B, j)]] = c.m_b[s] + c.m_w[s]
        for s, j, op in ckpt:
            offer = c.offer(s, op)
            assert offer is not None
            dur[ident[(s, Op.F, j)]] = offer.t_f
            mem[ident[(s, Op.F, j)]] = offer.keep
        return dur, mem

    def pairable(self, f: int, b: int) -> bool:
        """Whether forward f and the pass b may run as one overlapped pair: b a backward (B or
        BW: one id) of another microbatch."""
        x, y = self.actions[f], self.actions[b]
        return x.op is Op.F and y.op is Op.B and x.mb != y.mb

    def pair_time(self, f: int, b: int, dur: list[float]) -> float:
        """What the pair of forward f and backward b costs (``CostModel.pair_time``)."""
        return self.cost.pair_time(self.actions[f], self.actions[b], dur[f], dur[b])

    def valid_pairs(self, rows: list[list[int]], pairs: Pairs) -> Pairs:
        """The forwards of ``pairs`` that still have a backward to pair with right after them."""
        if not pairs:
            return pairs
        out = set()
        for row in rows:
            for i in range(len(row) - 1):
                if row[i] in pairs and self.pairable(row[i], row[i + 1]):
                    out.add(row[i])
        return frozenset(out)

    def score(self, rows: list[list[int]], dur: list[float], pairs: Pairs = _NONE) -> tuple[float, float] | None:
        """(objective, sum of rank spans, or for the iteration of rank iterations) of the ASAP
        timeline, None on a deadlock. ``pairs``: the forwards that run as one overlapped pair
        with the backward after them (where there is one: ``valid_pairs``)."""
        clock.simulated(len(dur))  # the work clock counts it as a simulation
        deps = self.deps
        end: list[float | None] = [None] * len(dur)
        R = len(rows)
        pos, free, first = [0] * R, [0.0] * R, [0.0] * R
        remaining = sum(map(len, rows))
        while remaining:
            progressed = False
            for r in range(R):
                row, i, t = rows[r], pos[r], free[r]
                n = len(row)
                while i < n:
                    k = row[i]
                    if pairs and k in pairs and i + 1 < n and self.pairable(k, row[i + 1]):
                        s = self._pair_start(t, k, row[i + 1], end)
                        if s is None:
                            break
                        if i == 0:
                            first[r] = s
                        t = end[k] = end[row[i + 1]] = s + self.pair_time(k, row[i + 1], dur)
                        i += 2
                        continue
                    s = t
                    for d, delay in deps[k]:
                        e = end[d]
                        if e is None:
                            break
                        if e + delay > s:
                            s = e + delay
                    else:
                        if i == 0:
                            first[r] = s
                        t = end[k] = s + dur[k]
                        i += 1
                        continue
                    break
                if i != pos[r]:
                    remaining -= i - pos[r]
                    pos[r], free[r] = i, t
                    progressed = True
            if not progressed:
                return None
        spans = [free[r] - first[r] for r in range(R) if rows[r]]
        total = sum(spans)
        if self.lane is not None:  # each rank's reductions one at a time, in the order they are ready
            value = each = 0.0
            for r in range(R):
                if not rows[r]:
                    continue
                ready = sorted((max(e for k in ks if (e := end[k]) is not None), t) for ks, t in self.lane[r]
                               if any(end[k] is not None for k in ks))
                busy = lane_runs(ready)[-1][1] if ready else 0.0
                mine = max(free[r], busy) + self.opt[r] - first[r]
                value, each = max(value, mine), each + mine
            return value, each
        if self.span:
            return max(spans), total
        return max(free) - min(first[r] for r in range(R) if rows[r]), total

    def _pair_start(self, t: float, f: int, b: int, end: list[float | None]) -> float | None:
        """When the pair of f and b can start, its rank free at t: both passes' inputs there
        (None: one is not run yet)."""
        for k in (f, b):
            for d, delay in self.deps[k]:
                e = end[d]
                if e is None:
                    return None
                if e + delay > t:
                    t = e + delay
        return t

    def pair_moves(self, row: list[int], pairs: Pairs, i: int, limit: float, reach: int,
                   mem: list[float]) -> list[tuple[list[int], Pairs]]:
        """The rows and pairs that pairing the forward at row[i] gives (with the backward after
        it, or with a later backward within ``reach`` pulled up to just after it, the passes in
        between moving down by one, within the memory limit and its rank's own dependencies),
        or unpairing it where it is paired."""
        k = row[i]
        if k in pairs:
            return [(row, pairs - {k})]
        if self.actions[k].op is not Op.F:
            return []
        out: list[tuple[list[int], Pairs]] = []
        held = {x for x in pairs} | {row[j + 1] for j in range(len(row) - 1) if row[j] in pairs}
        for j in range(i + 1, min(len(row), i + 1 + reach)):
            b = row[j]
            if b in held or not self.pairable(k, b) or (j > i + 1 and self.before[b] & set(row[i + 1:j])):
                continue  # (held by a pair, or a pass between that b needs: b cannot move up past it)
            new = row if j == i + 1 else _moved(row, j, i + 1)
            if new is row or max(_prefix(mem, new), default=0.0) <= limit:
                out.append((new, pairs | {k}))
        return out

    def fuse_pair_moves(self, row: list[int], pairs: Pairs, i: int, state: State, limit: float,
                        reach: int) -> list[tuple[list[int], State, Pairs]]:
        """Fusing or splitting the backward at row[i] together with re-pairing it, for a BW that
        pays only inside a pair (or a B + W only outside one), where neither step alone
        shortens the schedule: each toggle (``toggles``) with the backward unpaired where it
        was paired, or where it was free, paired with a free forward of another microbatch
        within ``reach`` before it (the backward pulled up to just after it, or the forward
        pushed down to just before it); each within the memory limit and the rank's own
        dependencies."""
        b = row[i]
        if self.actions[b].op is not Op.B or self.actions[b].stage not in self.choice:
            return []
        paired_by = next((row[j - 1] for j in (i,) if j > 0 and row[j - 1] in pairs), None)
        out: list[tuple[list[int], State, Pairs]] = []
        for cand, new in self.toggles(row, i, state, limit, reach):
            if paired_by is not None:
                out.append((cand, new, pairs - {paired_by}))
                continue
            _, mem = self.costs(new)
            at = cand.index(b)
            held = set(pairs) | {cand[j + 1] for j in range(len(cand) - 1) if cand[j] in pairs}
            for q in range(max(0, at - reach), at):
                f = cand[q]
                if f in held or not self.pairable(f, b):
                    continue
                between = set(cand[q + 1:at])
                moved = []
                if not self.before[b] & between:
                    moved.append(_moved(cand, at, q + 1))  # the backward up to just after the forward
                if at > q + 1 and not self.after[f] & between:
                    moved.append(_moved(cand, q, at - 1))  # the forward down to just before the backward
                for row2 in moved:
                    if max(_prefix(mem, row2), default=0.0) <= limit:
                        out.append((row2, new, pairs | {f}))
        return out

    def targets(self, row: list[int], i: int, prefix: list[float], limit: float, reach: int, mem: list[float]) -> list[int]:
        """Positions pass row[i] may move to (at most ``reach`` away) without passing a pass of
        its rank it depends on or that depends on it, and within the memory limit. ``prefix``:
        memory after each pass of the row (deltas ``mem``)."""
        k, d = row[i], mem[row[i]]
        out = []
        # earlier: memory between the new and the old place rises by d
        peak = float("-inf")
        for j in range(i - 1, max(-1, i - 1 - reach), -1):
            if row[j] in self.before[k]:
                break
            peak = max(peak, (prefix[j - 1] if j > 0 else 0.0) + d, prefix[j] + d)
            if peak > limit:
                break
            out.append(j)
        # later: memory between the old and the new place falls by d
        peak = float("-inf")
        for j in range(i + 1, min(len(row), i + 1 + reach)):
            if row[j] in self.after[k]:
                break
            peak = max(peak, prefix[j] - d)
            if peak > limit:
                break
            out.append(j)
        return out

    def toggles(self, row: list[int], i: int, state: State, limit: float,
                reach: int) -> list[tuple[list[int], State]]:
        """The rows and states that fusing or splitting the backward at row[i] gives (a backward
        on a stage where fusing may pay: fused, one; split, one per place of its W within
        ``reach`` after it), or recomputing the microbatch of the F at row[i] or not (a stage
        that offers it: each recompute pass at each place within ``reach`` after the F and
        before its backward; out; the other pass in its place); each within the memory limit."""
        a = self.actions[row[i]]
        fused, ckpt = state
        if a.op is Op.F and self.recompute.get(a.stage):
            return self._recompute_toggles(row, i, state, limit, reach)
        if a.op is not Op.B or a.stage not in self.choice:
            return []
        key = (a.stage, a.mb)
        w = self.id[(a.stage, Op.W, a.mb)]
        if key in fused:
            new = fused - {key}
            base = row[:i + 1] + row[i + 1:]
            cands = [base[:q] + [w] + base[q:] for q in range(i + 1, min(len(base), i + 1 + reach) + 1)]
        else:
            new = fused | {key}
            cands = [[x for x in row if x != w]]
        _, mem = self.costs((new, ckpt))
        return [(cand, (new, ckpt)) for cand in cands if max(_prefix(mem, cand), default=0.0) <= limit]

    def _recompute_toggles(self, row: list[int], i: int, state: State, limit: float,
                           reach: int) -> list[tuple[list[int], State]]:
        a = self.actions[row[i]]
        fused, ckpt = state
        s, j = a.stage, a.mb
        now = next((op for op in self.recompute[s] if (s, j, op) in ckpt), None)
        out: list[tuple[list[int], State]] = []
        if now is not None:
            rid = self.id[(s, now, j)]
            gone = (fused, ckpt - {(s, j, now)})
            out.append(([x for x in row if x != rid], gone))
            for op in self.recompute[s]:
                if op is not now:
                    other = self.id[(s, op, j)]
                    out.append(([other if x == rid else x for x in row], (fused, gone[1] | {(s, j, op)})))
        else:
            b = self.id[(s, Op.B, j)]
            end = row.index(b) if b in row else len(row)
            for op in self.recompute[s]:
                rid = self.id[(s, op, j)]
                new = (fused, ckpt | {(s, j, op)})
                for q in range(i + 1, min(end, i + 1 + reach) + 1):
                    out.append((row[:q] + [rid] + row[q:], new))
        checked = []
        for cand, new in out:
            _, mem = self.costs(new)
            if max(_prefix(mem, cand), default=0.0) <= limit:
                checked.append((cand, new))
        return checked


def _prefix(mem: list[float], row: list[int]) -> list[float]:
    out, cur = [], 0.0
    for k in row:
        cur += mem[k]
        out.append(cur)
    return out


def _moved(row: list[int], i: int, j: int) -> list[int]:
    new = row[:i] + row[i + 1:]
    new.insert(j, row[i])
    return new


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = REL_TOL * max(1.0, abs(b[0]))
    return a[0] < b[0] - tol or (a[0] <= b[0] + tol and a[1] < b[1] - tol)


def local_search(
    problem: Problem,
    rows: list[list[Action]],
    deadline: float,
    *,
    reach: int | None = None,
    seed: int = 0,
    target: float = float("-inf"),
    evaluations: int | None = None,
) -> list[list[Action]]:
    """A schedule no worse than ``rows`` (valid, within the limit), searched until ``deadline``
    (``deadline.now()``) or until the objective reaches ``target`` (a lower bound: nothing better
    exists). ``rows``: a valid schedule, split, fused or mixed.
    ``reach``: how far a pass may move on its rank (default: anywhere). ``evaluations``: at
    most this many candidates simulated (a budget independent of the machine's speed).
    No overlapped pairs (``local_search_paired`` chooses them)."""
    return _search(problem, rows, None, deadline, reach, seed, target, evaluations, pairing=False)[0]


def local_search_paired(
    problem: Problem,
    rows: list[list[Action]],
    pairs: list[list[int]] | None,
    deadline: float,
    *,
    reach: int | None = None,
    seed: int = 0,
    target: float = float("-inf"),
    evaluations: int | None = None,
) -> tuple[list[list[Action]], list[list[int]] | None]:
    """``local_search`` from ``rows`` with overlapped ``pairs`` (None: none), choosing pairs too
    where the passes hold all-to-all: the rows and their pairs (None: none), no worse than the
    input's."""
    return _search(problem, rows, pairs, deadline, reach, seed, target, evaluations, pairing=True)


def _search(problem: Problem, rows: list[list[Action]], pairs: list[list[int]] | None, deadline: float,
            reach: int | None, seed: int, target: float, evaluations: int | None,
            pairing: bool) -> tuple[list[list[Action]], list[list[int]] | None]:
    given = pairs if pairs and any(pairs) else None
    if clock.now() >= deadline:
        return rows, given
    value0, tl0 = problem.evaluate(rows, given)
    if value0 <= target or not problem.fits(tl0):
        return rows, given
    model = _Model(problem, pairing or given is not None)
    state0: State = (frozenset((a.stage, a.mb) for row in rows for a in row if a.op is Op.BW),
                     frozenset((a.stage, a.mb, a.op) for row in rows for a in row if a.op in RECOMPUTES))
    ids = [[model.id[(a.stage, Op.B if a.op is Op.BW else a.op, a.mb)] for a in row] for row in rows]
    pairs0: Pairs = frozenset(ids[r][i] for r, at in enumerate(given or []) for i in at)
    rng = random.Random(seed)
    best, best_fused, best_pairs = cur, cur_fused, cur_pairs = ids, state0, pairs0
    cur_dur, cur_mem = model.costs(cur_fused)
    first = model.score(ids, cur_dur, cur_pairs)
    assert first is not None  # the core simulator just ran it
    best_score = cur_score = first
    R = len(ids)
    reach = reach if reach is not None else max(map(len, ids))
    used = 0
    misses = 0  # perturbations in a row that led to no better schedule
    toggling = model.choice or model.any_recompute

    def spent() -> bool:
        return (evaluations is not None and used >= evaluations) or clock.now() >= deadline

    while not spent() and best_score[0] > target:
        improved, tried = False, used
        moves = [(r, i, 0) for r in range(R) for i in range(len(cur[r]))]
        moves += ([(r, i, 1) for r, i, _ in moves if toggling] + [(r, i, 2) for r, i, _ in moves if model.pairing]
                  + [(r, i, 3) for r, i, _ in moves if model.pairing and model.choice])
        rng.shuffle(moves)  # positions on a rank shift as moves are kept: still valid ones
        prefixes = [_prefix(cur_mem, row) for row in cur]
        for r, i, kind in moves:
            if i >= len(cur[r]):
                continue
            cands: list[tuple[list[int], State, Pairs]]
            if kind == 1:  # fuse or split the backward at i, or recompute the forward at i or not
                cands = [(row, st, cur_pairs) for row, st in model.toggles(cur[r], i, cur_fused, model.allowed[r], reach)]
            elif kind == 2:  # pair the forward at i, or unpair it
                near, limit = min(reach, _PAIR_REACH), model.allowed[r]
                cands = [(row, cur_fused, ps) for row, ps in model.pair_moves(cur[r], cur_pairs, i, limit, near, cur_mem)]
            elif kind == 3:  # fuse or split the backward at i and pair or unpair it in one step
                cands = model.fuse_pair_moves(cur[r], cur_pairs, i, cur_fused, model.allowed[r], min(reach, _PAIR_REACH))
            else:
                cands = [(_moved(cur[r], i, j), cur_fused, cur_pairs)
                         for j in model.targets(cur[r], i, prefixes[r], model.allowed[r], reach, cur_mem)]
            for new_row, new_fused, new_pairs in cands:
                if spent():
                    break
                used += 1
                cand = list(cur)
                cand[r] = new_row
                dur = cur_dur if new_fused is cur_fused else model.costs(new_fused)[0]
                sc = model.score(cand, dur, new_pairs)
                if sc is not None and _better(sc, cur_score):
                    cur, cur_score, improved = cand, sc, True
                    cur_pairs = model.valid_pairs(cur, new_pairs)
                    if new_fused is not cur_fused:
                        cur_fused = new_fused
                        cur_dur, cur_mem = model.costs(cur_fused)
                        prefixes = [_prefix(cur_mem, row) for row in cur]
                    else:
                        prefixes[r] = _prefix(cur_mem, cand[r])
                    if _better(cur_score, best_score):
                        best, best_fused, best_pairs, best_score, misses = cur, cur_fused, cur_pairs, cur_score, 0
                    break
            if spent() or best_score[0] <= target:
                break
        if used == tried:
            break  # no move is allowed at all (e.g. the smallest memory limit)
        if not improved:  # a local optimum: perturb the best schedule, harder after each miss
            misses += 1
            cur, cur_fused = _perturb(model, best, best_fused, rng, reach, 2 + min(misses // 4, 10))
            cur_pairs = model.valid_pairs(cur, best_pairs)
            cur_dur, cur_mem = model.costs(cur_fused)
            used += 1
            sc = model.score(cur, cur_dur, cur_pairs)
            if sc is not None:
                cur_score = sc
            else:
                cur, cur_fused, cur_pairs, cur_score = best, best_fused, best_pairs, best_score
                cur_dur, cur_mem = model.costs(cur_fused)
    if best is ids and best_pairs == pairs0:
        return rows, given
    out = [[Action(a.stage, Op.BW, a.mb) if a.op is Op.B and (a.stage, a.mb) in best_fused[0] else a
            for a in (model.actions[k] for k in row)] for row in best]
    out_pairs = [[i for i in range(len(row) - 1) if row[i] in best_pairs and model.pairable(row[i], row[i + 1])]
                 for row in best]
    found = out_pairs if any(out_pairs) else None
    value, tl = problem.evaluate(out, found)
    return (out, found) if value <= value0 and problem.fits(tl) else (rows, given)


_PAIR_REACH = 8  # how far down a backward may be pulled up to pair with a forward


def _perturb(model: _Model, rows: list[list[int]], fused: State, rng: random.Random, reach: int,
             moves: int) -> tuple[list[list[int]], State]:
    """``rows`` after a few random valid moves or toggles (within memory; may deadlock, then
    discarded)."""
    out = list(rows)
    for _ in range(moves):
        r = rng.randrange(len(out))
        if not out[r]:
            continue
        i = rng.randrange(len(out[r]))
        if (model.choice or model.any_recompute) and rng.random() < 0.25:
            options = model.toggles(out[r], i, fused, model.allowed[r], min(reach, 4))
            if options:
                out[r], fused = rng.choice(options)
            continue
        _, mem = model.costs(fused)
        ok = model.targets(out[r], i, _prefix(mem, out[r]), model.allowed[r], min(reach, 4), mem)
        if ok:
            out[r] = _moved(out[r], i, rng.choice(ok))
    return out, fused
