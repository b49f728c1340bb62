"""ZB-V: two chunks per rank in a V, zero bubble at 1F1B's memory (Qi et al., arXiv 2401.10241 v1+).

Rank r holds stage ``lo = r`` (chunk 0, on the way down) and stage ``hi = 2p-1-r`` (chunk 1, on
the way back up), so rank 0 holds both the first and the last stage: every rank gets forwards
and backwards from both directions, and the first backward reaches rank 0 as soon as
microbatch 0 has gone down and back up. Memory is capped at p * M_B per rank, M_B being what one
microbatch's forwards leave on the rank (1F1B's peak).

There is no closed rule for the order once F, B and W take different times, so like the paper
we build it greedily: passes are placed rank by rank and timed as they are placed (start = the
later of the rank being free and the inputs arriving, which is what ``simulate`` computes),
with each stage's own times, communication delays and memory.

1. Warm-up. Forwards go down on chunk 0. Rank r runs chunk-0 forwards while microbatch 0 goes
   to rank p-1 and comes back up to it, keeping room for the forwards it must take before its
   first backward (r+1 on chunk 1, interleaved with r more on chunk 0). Then, from rank 1 down,
   each rank runs forwards, alternating chunks, until it has done as many as the rank before it
   and one more on chunk 1, so that the rank before it has input for its own chunk 1.
2. Steady state, in rounds: every rank runs one B, then one F, which keeps the activations in
   flight constant, as in 1F1B. B: chunk 0 if its input is there (the older microbatch), else
   chunk 1. F: chunk 1 if its input is there (its B follows soonest), else chunk 0. Chunk-0
   backwards are placed from rank p-1 to rank 0 and chunk-1 ones from rank 0 to rank p-1, so a
   backward can cross the whole pipeline in one round.
3. W passes fill the waits. Before a B or F whose input is still in flight, a W runs if it ends
   before the input arrives, or if waiting would make this rank's span the longest (for
   chunk-1 B and for F only when ``fill_b`` / ``fill_f``); a W also runs whenever an F needs
   the memory it frees. The W passes left over run at the end.

These are the rules of the authors' released heuristic, which assumes equal stages; here the
waits are timed with each stage's real costs and "the longest span" compares busy + idle per
rank, so unequal ranks are judged fairly. As there, the construction is repeated with each
rank's slack in the previous attempt (how much shorter than the longest its span was) as an
allowance to wait rather than delay an input with a W, and over the four ``fill_b`` /
``fill_f`` choices; the shortest span wins.

Memory. A pass is placed only if the rank stays within its limit, counting for each
microbatch the most it will still hold (an F reserves its stage's peak; B and W only release).
A chunk-0 forward must also leave room for one chunk-1 forward beyond the microbatches still
waiting for theirs. B and W never wait for memory, so the oldest unfinished microbatch can
always make its next pass: every round places something and, since each pass is placed after
the passes it depends on, the schedule cannot deadlock. (The only exception is a profile
whose F, B, W deltas leave memory behind per microbatch, which eventually fills any limit;
that is reported as an error.)

With T_F = T_B = T_W and no communication delay this is zero bubble at p * M_B for m >= 2p - 1;
for p <= m < 2p - 1 the warm-up is not covered and the span is (2p - 1 - m) chunk-forward
times longer.
"""

from __future__ import annotations

from collections import deque
from itertools import product

from ..actions import Action, Op
from ..clock import passed
from ..costs import CostModel
from ..dependencies import input_arrival, type_graph
from ..errors import ZbError
from ..layout import placement
from ..limits import fits
from ..tolerances import EPS_MS


def zb_v(cost: CostModel, m: int, deadline: float | None = None) -> list[list[Action]]:
    """The best of the constructions described above; once ``deadline`` has passed, the best of
    those built so far (at least one: ``deadline.passed``)."""
    p = cost.num_ranks
    if list(cost.stage_to_rank) != placement(p, 2, "v"):
        raise ZbError("zb-v needs the V placement: rank r holds stages r and 2p-1-r")
    limit = [p * cost.activation_unit(r) for r in range(p)]
    best_rows, best = None, float("inf")
    for fill_b, fill_f in product((True, False), repeat=2):
        slack, last = None, float("inf")
        while True:
            rows, span = _Builder(cost, m, limit, fill_b, fill_f, slack).build()
            if max(span) < best - EPS_MS:
                best_rows, best = rows, max(span)
            if passed(deadline):
                assert best_rows is not None  # the first build beats inf
                return best_rows
            if max(span) >= last - EPS_MS:
                break
            last = max(span)
            slack = [last - s for s in span]
    assert best_rows is not None  # the first build beats inf
    return best_rows


class _Builder:
    """One construction: passes are placed round by round and timed as they are placed."""

    def __init__(self, cost: CostModel, m: int, limit: list[float], fill_b: bool, fill_f: bool, slack):
        p, S = cost.num_ranks, cost.num_stages
        self.m, self.p, self.S, self.limit = m, p, S, limit
        self.fill_b, self.fill_f = fill_b, fill_f
        self.slack = slack or [0.0] * p
        self.lo = list(range(p))
        self.hi = [S - 1 - r for r in range(p)]
        self.t = {Op.F: cost.t_f, Op.B: cost.t_b, Op.W: cost.t_w}
        self.graph = type_graph(cost)
        # The most a microbatch will still hold on stage s once its F, its B, its W has run.
        m_f, m_b, m_w = cost.m_f, cost.m_b, cost.m_w
        self.hold_f = [max(m_f[s], m_f[s] + m_b[s], m_f[s] + m_b[s] + m_w[s]) for s in range(S)]
        self.hold_b = [max(m_f[s] + m_b[s], m_f[s] + m_b[s] + m_w[s]) for s in range(S)]
        self.hold_w = [m_f[s] + m_b[s] + m_w[s] for s in range(S)]
        for r in range(p):
            need = self.hold_f[self.lo[r]] + self.hold_f[self.hi[r]]
            if not fits(need, limit[r]):
                raise ZbError(f"zb-v: on rank {r} one microbatch needs {need:g} of memory, over the limit {limit[r]:g}")
        self.busy = [cost.rank_busy(r, m) for r in range(p)]
        self.count = {op: [0] * S for op in (Op.F, Op.B, Op.W)}
        self.end = {op: [[0.0] * m for _ in range(S)] for op in (Op.F, Op.B)}
        self.free_at = [0.0] * p  # when the rank's last placed pass ends
        self.first: list[float | None] = [None] * p  # when the rank's first pass starts
        self.idle = [0.0] * p  # time the rank has waited since its first pass
        self.longest = max(self.busy)  # max over ranks of busy + idle: the span so far
        self.held = [0.0] * p  # memory reserved on the rank (see hold_*)
        self.pending_w: list[deque] = [deque() for _ in range(p)]
        self.rows: list[list[Action]] = [[] for _ in range(p)]
        self.placed = 0

    # ---- the phases ------------------------------------------------------------------

    def build(self) -> tuple[list[list[Action]], list[float]]:
        self.warm_up()
        while self.count[Op.B][0] < self.m or self.count[Op.F][self.S - 1] < self.m:
            before = self.placed
            for r, s in self.b_order():
                self.place_b(r, s)
            for r in range(self.p):
                self.place_f(r)
            if self.placed == before:  # only when completed microbatches leave memory behind
                raise ZbError("zb-v: the memory limit leaves no room for the next forward")
        for r in range(self.p):
            while self.pending_w[r]:
                self.put_w(r)
        spans = []
        for r in range(self.p):
            first = self.first[r]
            assert first is not None  # every rank runs passes
            spans.append(self.free_at[r] - first)
        return self.rows, spans

    def warm_up(self) -> None:
        p, m, lo, hi, f = self.p, self.m, self.lo, self.hi, self.count[Op.F]
        for r in range(p):
            self.put(r, Op.F, lo[r])
        # Microbatch 0 comes back up on chunk 1. Until it reaches rank r, ranks 0..r send more
        # microbatches down to r, which keeps room for the r+1 chunk-1 and r chunk-0 forwards
        # it takes before its first backward.
        for r in reversed(range(p)):
            arrival = self.input_time(Op.F, hi[r])
            assert arrival is not None  # its input, microbatch 0 on the stage before, is placed (loop above / last r)
            room = (r + 1) * self.hold_f[hi[r]] + r * self.hold_f[lo[r]]
            while (
                f[lo[r]] < m
                and self.free_at[r] + self.t[Op.F][lo[r]] <= arrival + EPS_MS
                and all(self.can_f(q, lo[q], room if q == r else 0.0) for q in range(r + 1))
            ):
                for q in range(r + 1):
                    self.put(q, Op.F, lo[q])
            self.put(r, Op.F, hi[r])
        # Each rank catches up with the one before it: as many forwards, and one more on chunk 1
        # so that rank has input. Waves of one chunk at a time go from rank p-1 up to rank r.
        chunk = 0
        for r in range(1, p):
            stalled = 0
            while stalled < 2 and (
                f[lo[r]] + f[hi[r]] < f[lo[r - 1]] + f[hi[r - 1]] or f[hi[r]] <= f[hi[r - 1]] < m
            ):
                progressed = False
                for q in reversed(range(r, p)):
                    s = (lo, hi)[chunk][q]
                    if self.input_time(Op.F, s) is not None and self.can_f(q, s):
                        self.put(q, Op.F, s)
                        progressed = True
                chunk = 1 - chunk
                stalled = 0 if progressed else stalled + 1

    def b_order(self) -> list[tuple[int, int]]:
        """(rank, stage) of each rank's B in this round. Ranks whose chunk-0 B has its input
        go first, from rank p-1 up, so one backward can climb them all in the round; the others
        then take chunk 1, from rank 0 down, so one backward can descend them all."""
        up, down = [], []
        b = self.count[Op.B]
        for r in range(self.p):
            lo, hi = self.lo[r], self.hi[r]
            if self.input_time(Op.B, lo) is not None or b[hi] == self.m > b[lo]:
                up.append((r, lo))
            else:
                down.append((r, hi))
        return up[::-1] + down

    def place_b(self, r: int, s: int) -> None:
        arrival = self.input_time(Op.B, s)
        if arrival is not None:
            self.fill(r, arrival, eager=s == self.lo[r] or self.fill_b)
            self.put(r, Op.B, s, arrival)

    def place_f(self, r: int) -> None:
        lo, hi, f = self.lo[r], self.hi[r], self.count[Op.F]
        arrival = self.input_time(Op.F, hi) if f[hi] < f[lo] else None
        s = hi
        if arrival is None:
            arrival, s = self.input_time(Op.F, lo), lo
            if arrival is None:
                return
        while not self.can_f(r, s) and self.pending_w[r]:
            self.put_w(r)  # W frees the memory this F needs
        if self.can_f(r, s):
            self.fill(r, arrival, eager=self.fill_f)
            self.put(r, Op.F, s, arrival)

    def fill(self, r: int, arrival: float, eager: bool) -> None:
        """W passes for the wait until the next pass's input arrives."""
        w = self.pending_w[r]
        while w and arrival >= self.free_at[r] + self.t[Op.W][w[0][0]] - EPS_MS:
            self.put_w(r)  # ends before the input arrives: free
        if eager and w and self.first[r] is not None:
            allowed = max(self.longest - self.busy[r], self.slack[r]) - self.idle[r]
            if arrival - self.free_at[r] > allowed + EPS_MS:
                self.put_w(r)  # waiting would make this rank the longest: delay the pass instead

    # ---- rules and bookkeeping ---------------------------------------------------------

    def input_time(self, op: Op, s: int) -> float | None:
        """When the inputs of the next (op, s) pass are there, None while one is unplaced."""
        j = self.count[op][s]
        return input_arrival(self.graph, s, op, j, self.count, self.end) if j < self.m else None

    def can_f(self, r: int, s: int, keep: float = 0.0) -> bool:
        """Whether an F on stage s fits on rank r with ``keep`` to spare; on chunk 0 it must also
        leave room for one chunk-1 forward beyond the microbatches still waiting for theirs."""
        if not fits(self.held[r] + self.hold_f[s] + keep, self.limit[r]):
            return False
        lo, hi, f, w = self.lo[r], self.hi[r], self.count[Op.F], self.count[Op.W]
        if s != lo:
            return True
        left_behind = w[lo] * self.hold_w[lo] + w[hi] * self.hold_w[hi]  # by completed microbatches
        waiting = (f[lo] - f[hi] + 1) * self.hold_f[lo]
        return fits(left_behind + waiting + self.hold_f[hi], self.limit[r])

    def put(self, r: int, op: Op, s: int, arrival: float | None = None) -> None:
        j = self.count[op][s]
        ready = self.input_time(op, s) if arrival is None else arrival
        assert ready is not None  # passes are put only once their inputs are placed
        start = max(self.free_at[r], ready)
        if self.first[r] is None:
            self.first[r] = start
        else:
            self.idle[r] += start - self.free_at[r]
            self.longest = max(self.longest, self.busy[r] + self.idle[r])
        self.free_at[r] = self.end[op][s][j] = start + self.t[op][s]
        self.count[op][s] += 1
        self.rows[r].append(Action(s, op, j))
        self.placed += 1
        if op is Op.F:
            self.held[r] += self.hold_f[s]
        else:
            self.held[r] += self.hold_b[s] - self.hold_f[s]
            self.pending_w[r].append((s, j))

    def put_w(self, r: int) -> None:
        s, j = self.pending_w[r].popleft()
        self.free_at[r] += self.t[Op.W][s]
        self.count[Op.W][s] += 1
        self.held[r] += self.hold_w[s] - self.hold_b[s]
        self.rows[r].append(Action(s, Op.W, j))
        self.placed += 1
