"""A lower bound over every cut of a placement at once, where there are too many cuts to price.

For each rank of a cut, whatever the schedule (``zbsearch.bounds`` proves each for one cut):

* busy: the rank runs m forwards and m backwards of each of its stages, each unit at its least
  (``unit_work``: a forward checkpointed and recomputed counted with its recompute pass, where
  ``recompute`` allows);
* fill: its first backward cannot start before one microbatch has gone forward from its first
  stage to the last stage and backward to its own: every unit on the way at its least forward
  and input-gradient time, each link between two ranks at the cheapest unit's. Until then it
  runs forwards (and recompute passes) only, at most m of each stage, and without
  recomputation under a budget no more than its limit holds (the budget less its parameters,
  gradients and optimizer state: a fractional knapsack), so it idles the rest of that time
  (``rank_memory_span_lower_bounds``); its span is at least busy plus that idle time;
* area (under a budget): each microbatch runs each of the rank's stages in one way the mode
  allows (plain; checkpointed and recomputed, fully or selectively), which adds its time
  beyond the least forward and keeps its bytes from its forward's end to its backward's start,
  at least the dependency path through the later stages apart. Those bytes never exceed what
  the budget leaves the rank's activations, so over the span T their integral is at most that
  times T, while T is at least busy plus the time the ways add: the least T over every
  fractional choice of ways (``rank_area_span_lower_bounds`` proves the same for one cut).

The runtime's host time per action (``LayerProfile.t_action``, whole on every pass of every
stage) adds at least two to the busy time per microbatch and piece (its forward and its
backward, fused or not; a recompute pass's is left out), one of them to the forwards' side
(``action_floor``). The fill path leaves it out: a shorter path is still a path.

With expert-parallel all-to-all in the units (``a_f``, ``a_b``), where overlapped pairs may
hide it, the busy time counts every forward and backward at its least in a pair, its time less
its all-to-all (``paired_floor``, as ``CostModel.paired_floor`` prices them for the solver's
bounds); the fill path keeps the passes' own times, since a pair ends no sooner than either of
its passes alone, and before the fill path ends the rank has no backward to pair a forward with.
Counting the forwards it runs meanwhile at their least keeps the bound sound: each keeps its
all-to-all, which the busy time left out.

A cut one of whose ranks cannot hold one microbatch's activations has no schedule and is left
out, as ``search.Cuts`` leaves it out. For the makespan, a rank's bound starts once the forwards
of one microbatch have reached it.

Each rank's bound depends only on its own units and on where the stages after its first end
(one stage per rank: the units after its stage; the V: the units from its first piece on and
after its second piece), so the least over every cut of the largest over ranks is a dynamic
program over where each rank's stages start and end: one stage per rank, stage by stage; the
V, rank by rank from the outside in, both pieces of a rank at once. A rank whose bound is
already above a cut's (the most balanced one's) is pruned as soon as seen. Where the program
would outlast its ``deadline``, the bound falls back to the busiest rank's work (``work_bound``).

The bound is below the solver's quick bound of every cut (``Cuts.evaluate``'s key), which
counts the same facts on each cut's own costs and more.
"""

from __future__ import annotations

import itertools
import math

from .. import clock
from ..formats.layers import LayerProfile, Unit
from ..limits import allowance
from .compose import Placement, least_kept, stage_cost
from .memory import parameter_bytes

# Shares above the busiest rank's work that the program is asked about first (``relaxed_bound``).
_TRIES = (0.03, 0.06, 0.12, 0.25, 0.5)

__all__ = ["relaxed_bound", "work_bound", "RankBounds", "unit_work", "action_floor", "paired_floor", "min_max_cut"]


def action_floor(layers: LayerProfile) -> float:
    """The least host time per action one microbatch costs a stage, whatever the schedule: its
    forward's and its backward's (``LayerProfile.t_action`` each; absent: 0)."""
    return 2.0 * (layers.t_action or 0.0)


def unit_work(layers: LayerProfile, recompute: str = "none") -> list[float]:
    """Per unit, the least compute one microbatch needs there: the cheaper forward and backward,
    a forward checkpointed and recomputed counted with its recompute pass where ``recompute``
    allows it (``auto``: the cheapest way; ``full``: every microbatch recomputed), each forward
    and backward at its least in an overlapped pair (``paired_floor``)."""
    return [_least_forward(u, recompute) + _least_backward(u) for u in map(paired_floor, layers.units)]


def paired_floor(u: Unit) -> Unit:
    """``u`` with its forwards (plain, fused, checkpointed) and backwards (B, BW) shortened by
    their all-to-all, as ``CostModel.paired_floor`` shortens a stage's: the least each can take
    in an overlapped pair. W and recompute passes keep their times; ``u`` itself without
    all-to-all."""
    if not (u.a_f or u.a_b):
        return u

    keep = 1.0 - (u.pair_exposed or 0.0)  # a pair takes off what it hides less the share left exposed

    def less(t: float | None, a: float) -> float | None:
        return None if t is None else max(0.0, t - keep * a)

    return u.model_copy(update={"t_f": less(u.t_f, u.a_f), "t_ff": less(u.t_ff, u.a_f), "t_fc": less(u.t_fc, u.a_f),
                                "t_fs": less(u.t_fs, u.a_f), "t_b": less(u.t_b, u.a_b), "t_bw": less(u.t_bw, u.a_b),
                                "a_f": 0.0, "a_b": 0.0, "pair_exposed": None})


def _least_backward(u: Unit) -> float:
    return min(u.t_b + u.t_w, u.fused_backward)


def _least_forward(u: Unit, recompute: str) -> float:
    """The least a unit's forward, with its recompute pass where recomputed, can cost a stage."""
    plain = min(u.t_f, u.fused_forward)
    rf = u.fused_recompute  # before a fused backward; None exactly where t_r is
    recompute_pass = None if u.t_r is None or rf is None else min(u.t_r, rf)
    full = None if recompute_pass is None or u.m_fc is None else min(plain, u.t_fc or plain) + recompute_pass
    if recompute == "full":
        return plain if full is None else full
    if recompute == "none":
        return plain
    selective = None if u.t_rs is None or u.m_fs is None else min(plain, u.t_fs or plain) + u.t_rs
    return min(x for x in (plain, full, selective) if x is not None)


def _path_forward(u: Unit, recompute: str) -> float:
    """The least a unit's forward takes on a dependency path: its cheapest way to run (a
    checkpointed one where ``recompute`` allows it), without the recompute pass."""
    ways = [u.t_f, u.fused_forward]
    if recompute != "none" and u.t_fc is not None and u.t_r is not None and u.m_fc is not None:
        ways.append(u.t_fc)
    if recompute == "auto" and u.t_fs is not None and u.t_rs is not None and u.m_fs is not None:
        ways.append(u.t_fs)
    return min(ways)


def min_max_cut(w: list[float], stages: int) -> tuple[int, ...]:
    """The contiguous cut of ``w`` into ``stages`` non-empty groups whose largest sum is least."""
    n = len(w)
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = math.inf
    # best[k][i]: least largest sum cutting w[:i] into k groups; arg for the cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v <= best[k][i]:
                    best[k][i], arg[k][i] = v, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = arg[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def relaxed_bound(layers: LayerProfile, num_ranks: int, placement: Placement, m: int, recompute: str = "none", *,
                  budget: float | None = None, optimizer: str = "adamw", deadline: float | None = None,
                  objective: str = "span", shard: int | None = None, cap: float = math.inf) -> float:
    """A lower bound on the span of every schedule of every cut of this placement within
    ``budget`` bytes per rank (None: unlimited; parameters, gradients and optimizer state as
    ``optimizer`` counts them, sharded over ``shard`` data-parallel ranks where given),
    recomputing as ``recompute`` allows (see the module); inf where no cut fits. ``objective``
    "makespan": on the makespan, each rank's bound after the forwards of one microbatch reach it
    (every other objective is at least the span).
    ``deadline`` (``deadline.now()``): past it, the largest value the program has proven
    every cut to reach (at least the busiest rank's work). ``cap``: a value the caller needs
    the bound only up to (the best found elsewhere): where every cut's is at least that,
    ``cap`` is returned, sooner.

    The program prunes every partial cut above the value it is asked about, so it first runs
    below a few values growing from the busiest rank's work (``_TRIES``): each that no cut is
    below is proven, and the first that some cut is below gives the least itself; then below
    ``cap``."""
    proven = work_bound(layers, num_ranks, placement, m, recompute)
    ranks = RankBounds(layers, num_ranks, placement, m, recompute, budget, optimizer, deadline, objective, shard, cap)
    try:
        for grow in (*_TRIES, math.inf):
            below = min(cap, proven * (1 + grow))
            ranks.cap = below
            got = ranks.least()
            if got < below or below >= cap:
                return got
            proven = below  # no cut is below it
        return proven  # (not reached: the last try is below cap)
    except _Late:
        return proven


def work_bound(layers: LayerProfile, num_ranks: int, placement: Placement, m: int, recompute: str = "none") -> float:
    """m times the least, over every cut of this placement, of the busiest rank's work (exact
    by dynamic programming for one stage per rank; for the V the larger of the mean over ranks
    and rank 0's first and last units): a bound on the span of every schedule of every cut."""
    w = unit_work(layers, recompute)
    host = action_floor(layers)  # per microbatch and piece
    if placement == "one":
        counts = min_max_cut(w, num_ranks)
        return m * (max(sum(w[lo:hi]) for (lo, hi), in rank_pieces(counts, "one")) + host)
    return m * max(sum(w) / num_ranks + 2 * host, w[0] + w[-1] + 2 * host, max(w) + host)


class _Late(Exception):
    """The dynamic program ran past its deadline."""


class RankBounds:
    """Per-rank bounds of any cut of one placement (see the module), from prefix sums over the
    units: of one cut (``of_cut``), and the least over every cut of the largest (``least``)."""

    def __init__(self, layers: LayerProfile, num_ranks: int, placement: Placement, m: int, recompute: str = "none",
                 budget: float | None = None, optimizer: str = "adamw", deadline: float | None = None,
                 objective: str = "span", shard: int | None = None, cap: float = math.inf) -> None:
        self.layers, self.P, self.placement, self.m = layers, num_ranks, placement, m
        self.cap = cap  # the least is wanted only below it (``relaxed_bound``)
        self.makespan = objective == "makespan"  # ``least`` bounds the makespan: each rank from when it can start
        self.recompute, self.budget, self.optimizer, self.deadline = recompute, budget, optimizer, deadline
        self.shard = shard
        self.N = n = layers.num_units
        self.S = num_ranks * (2 if placement == "v" else 1)
        us = layers.units
        self.w = unit_work(layers, recompute)
        # a forward's side of the busy time (with R), at its least in a pair as the busy time counts it
        ahead = [_least_forward(paired_floor(u), recompute) for u in us]
        self.pre_w, self.pre_ahead = _prefix(self.w), _prefix(ahead)
        self.pre_f = _prefix([_path_forward(u, recompute) for u in us])  # on the fill path
        self.pre_b = _prefix([min(u.t_b, u.fused_backward) for u in us])  # input gradients on the fill path
        self.pre_mf = _prefix([u.m_f for u in us])
        self.link = min((layers.comm(i) for i in range(n - 1)), default=0.0)
        self.host = action_floor(layers)  # per microbatch and piece, half of it on the forwards' side
        # the memory-aware idle needs activations that only F allocates and only a backward frees
        self.memory = budget is not None and recompute == "none"
        self.pre_static = _prefix([parameter_bytes(u.params, u.param_bytes, optimizer, shard) + u.frozen_bytes for u in us])
        self.tied = [(i, u.tied) for i, u in enumerate(us) if u.tied]
        self.keeps: dict[tuple[int, int], float] = {}
        self.stage_ways: dict[tuple[int, int], list[tuple[float, float]]] = {}
        self.areas: dict[tuple[int, int, int], tuple[float, float, list[tuple[float, float]]] | None] = {}
        self.steps = 0

    # ---- one rank's bound ---------------------------------------------------------------

    def limit(self, pieces: list[tuple[int, int]]) -> float:
        """What activations may hold on a rank with these unit ranges (inf: no budget)."""
        if self.budget is None:
            return math.inf
        static = sum(self.pre_static[hi] - self.pre_static[lo] for lo, hi in pieces)
        keys = {k for i, tied in self.tied if any(lo <= i < hi for lo, hi in pieces) for k in tied}
        static += sum(parameter_bytes(self.layers.tied[k].params, self.layers.tied[k].param_bytes, self.optimizer, self.shard)
                      for k in keys)
        return self.budget - static

    def kept(self, lo: int, hi: int) -> float:
        """The least a microbatch keeps on a stage of units ``[lo, hi)`` until its backward."""
        got = self.keeps.get((lo, hi))
        if got is None:
            got = self.keeps[(lo, hi)] = least_kept(self.layers, lo, hi, self.recompute)
        return got

    def rank(self, pieces: list[tuple[int, int]], fill: float, r: int) -> float:
        """The bound on the span of rank ``r`` holding ``pieces`` (in model order) whose fill
        path (forward from its first stage to the last, backward to its last stage) takes
        ``fill``; inf where it cannot hold one microbatch's activations."""
        self.steps += 1
        if self.deadline is not None and self.steps & 1023 == 1 and clock.now() > self.deadline:
            raise _Late
        lim = self.limit(pieces)
        need, before = 0.0, 0.0
        for lo, hi in pieces:  # as compose.activation_need counts it
            m_f = self.pre_mf[hi] - self.pre_mf[lo]
            need = max(need, before + m_f)
            before += min(m_f, self.kept(lo, hi))
        if self.budget is not None and not (lim > 0 and need <= allowance(lim)):
            return math.inf
        m = self.m
        host = m * len(pieces) * self.host
        busy = m * sum(self.pre_w[hi] - self.pre_w[lo] for lo, hi in pieces) + host
        ahead = m * sum(self.pre_ahead[hi] - self.pre_ahead[lo] for lo, hi in pieces)  # every forward (and R)
        if self.memory:
            ahead = min(ahead, _forward_room(self, pieces, allowance(lim)))
        ahead += host / 2  # at most m forwards per piece: their host time on top of either
        bound = busy + max(0.0, fill - ahead)
        if self.budget is not None and (self.recompute == "full" or self.plain_area(pieces, r) > allowance(lim) * bound):
            bound = max(bound, self.area(pieces, r, busy, allowance(lim)))  # (else every microbatch plain fits it)
        return bound

    def plain_area(self, pieces: list[tuple[int, int]], r: int) -> float:
        """What every microbatch held plain on ``pieces`` of rank ``r`` holds (see ``area``)."""
        n = self.N
        return self.m * sum((self.pre_mf[hi] - self.pre_mf[lo]) * (self.forward(hi, n) + self.backward(hi, n)
                                                                     + links * self.link)
                            for (lo, hi), links in zip(pieces, self.links_after(r)))

    def ways(self, lo: int, hi: int) -> list[tuple[float, float]]:
        """Per way the mode allows a microbatch to run the stage of units ``[lo, hi)``: (what it
        keeps from its forward's end to its backward's start, the time its forward and recompute
        pass take beyond the units' least forwards, ``unit_work``'s)."""
        got = self.stage_ways.get((lo, hi))
        if got is None:
            c = stage_cost(self.layers, lo, hi)
            least = self.pre_ahead[hi] - self.pre_ahead[lo]
            if c.m_f + (c.m_b or 0.0) < 0:  # a backward frees more than the forward allocated: nothing held counts
                self.stage_ways[(lo, hi)] = []
                return []
            ways = [] if self.recompute == "full" else [(c.m_f, min(c.t_f, c.fused_forward))]
            if self.recompute != "none" and c.t_r is not None and c.m_fc is not None and c.t_fc is not None:
                ways.append((c.m_fc, c.t_fc + min(c.t_r, c.t_rf if c.t_rf is not None else c.t_r)))
            if self.recompute == "auto" and c.t_rs is not None and c.m_fs is not None and c.t_fs is not None:
                ways.append((c.m_fs, c.t_fs + c.t_rs))
            got = self.stage_ways[(lo, hi)] = [(keep, max(0.0, t - least)) for keep, t in ways]
        return got

    def area(self, pieces: list[tuple[int, int]], r: int, busy: float, room: float) -> float:
        """The span's bound from the area its microbatches hold (see the module): the least T
        with T >= busy + the extra time of the ways chosen and room x T >= the area they hold,
        over every fractional choice of ways (a multiple-choice knapsack's LP relaxation, below
        every whole choice); busy where nothing is held."""
        if room <= 0:
            return math.inf
        extra = area = 0.0
        steps: list[tuple[float, float]] = []  # (area saved per ms of extra, ms): every microbatch's hull steps
        for (lo, hi), links in zip(pieces, self.links_after(r)):
            got = self.piece_area(lo, hi, links)
            if got is None:
                return busy
            extra += got[0]
            area += got[1]
            steps += got[2]
        t = busy + extra
        short = area - room * t  # area not yet covered by room x T
        for rate, length in sorted(steps, reverse=True):
            if short <= 0:
                break
            used = min(length, short / (room + rate))
            t += used
            short -= used * (room + rate)
        if short > 0:
            t += short / room
        return t

    def piece_area(self, lo: int, hi: int, links: int) -> tuple[float, float, list[tuple[float, float]]] | None:
        """For m microbatches on the stage of units ``[lo, hi)`` with ``links`` links after it:
        the extra time and area of the least-extra way, and the steps of the lower hull of the
        others (area saved per ms, ms); None where nothing held counts (``ways``)."""
        key = (lo, hi, links)
        if key in self.areas:
            return self.areas[key]
        ways = self.ways(lo, hi)
        out = None
        if ways:
            held = self.forward(hi, self.N) + self.backward(hi, self.N) + links * self.link
            hull = _lower_hull([(x, keep * held) for keep, x in ways])
            m = self.m
            out = (m * hull[0][0], m * hull[0][1],
                   [((a0 - a1) / (x1 - x0), m * (x1 - x0)) for (x0, a0), (x1, a1) in zip(hull, hull[1:])])
        self.areas[key] = out
        return out

    def links_after(self, r: int) -> list[int]:
        """Per stage of rank ``r`` (in model order), the links between ranks a microbatch crosses
        after it, forward and back (the V's turn stays on one rank)."""
        if self.placement == "one":
            return [2 * (self.P - 1 - r)]
        return [2 * (self.S - 2 - r), 2 * r]

    # ---- the least over cuts ------------------------------------------------------------

    def least(self) -> float:
        """The least over every cut of its largest rank bound."""
        return self.one() if self.placement == "one" else self.v()

    def one(self) -> float:
        """One stage per rank: stage by stage, the least largest bound of the stages so far for
        each place the current stage may end."""
        N, S = self.N, self.S
        cap = min(self.cap, self.cut_value(min_max_cut(self.w, S)))
        best = {0: 0.0}
        for r in range(S):
            nxt: dict[int, float] = {}
            after = S - 1 - r  # stages after this one
            for lo, so_far in best.items():
                for hi in range(lo + 1, N - after + 1):
                    if self.m * (self.pre_w[hi] - self.pre_w[lo]) > cap:
                        break  # busier still further on
                    fill = self.forward(lo, N) + self.backward(hi, N) + 2 * after * self.link
                    v = max(so_far, self.start(lo, r) + self.rank([(lo, hi)], fill, r))
                    if v <= cap and v < nxt.get(hi, math.inf):
                        nxt[hi] = v
            best = nxt
        return best.get(N, cap)

    def v(self) -> float:
        """The V: rank by rank from the outside in, the least largest bound of the ranks so far for
        each pair (where the rank's first piece ends, where its second starts)."""
        N, P = self.N, self.P
        cap = min(self.cap, self.cut_value(min_max_cut(self.w, self.S)))
        best = {(0, N): 0.0}
        for r in range(P):
            inner = 2 * (P - 1 - r)  # pieces left between this rank's two
            nxt: dict[tuple[int, int], float] = {}
            for (a, d), so_far in best.items():
                for b in range(a + 1, d):
                    left = self.m * (self.pre_w[b] - self.pre_w[a])
                    if left > cap:
                        break
                    # the second piece [c, d): the innermost rank's two pieces meet
                    cs = [b] if r == P - 1 else range(d - 1, b + inner - 1, -1)
                    for c in cs:
                        if c >= d or left + self.m * (self.pre_w[d] - self.pre_w[c]) > cap:
                            break
                        # the fill path: forward from the first piece to the last stage, backward to
                        # the second piece; every link crossed but the V's turn (on one rank)
                        fill = self.forward(a, N) + self.backward(d, N) + (2 * P - 2) * self.link
                        v = max(so_far, self.start(a, r) + self.rank([(a, b), (c, d)], fill, r))
                        if v <= cap and v < nxt.get((b, c), math.inf):
                            nxt[(b, c)] = v
            best = nxt
        return min(best.values(), default=cap)

    def forward(self, lo: int, hi: int) -> float:
        return self.pre_f[hi] - self.pre_f[lo]

    def start(self, lo: int, r: int) -> float:
        """For the makespan, the earliest rank r's first stage (from unit ``lo``) can start: the
        forwards of the units before it and the r links on the way; 0 for the span."""
        return self.pre_f[lo] + r * self.link if self.makespan else 0.0

    def backward(self, lo: int, hi: int) -> float:
        return self.pre_b[hi] - self.pre_b[lo]

    def of_cut(self, counts: tuple[int, ...]) -> list[float]:
        """Per rank, its bound in the cut ``counts`` (units per stage); inf on a rank that
        cannot hold it."""
        P, N = self.P, self.N
        out = []
        for r, ps in enumerate(rank_pieces(counts, self.placement)):
            if self.placement == "one":
                fill = self.forward(ps[0][0], N) + self.backward(ps[0][1], N) + 2 * (P - 1 - r) * self.link
            else:
                fill = self.forward(ps[0][0], N) + self.backward(ps[1][1], N) + (2 * P - 2) * self.link
            out.append(self.rank(ps, fill, r))
        return out

    def cut_value(self, counts: tuple[int, ...]) -> float:
        """The largest rank bound of the cut ``counts`` (for the makespan, each from when its rank
        can start): a cap for the program (the least is no larger)."""
        pieces = rank_pieces(counts, self.placement)
        return max(self.start(ps[0][0], r) + b for r, (ps, b) in enumerate(zip(pieces, self.of_cut(counts))))


def _forward_room(ranks: RankBounds, pieces: list[tuple[int, int]], room: float) -> float:
    """The most forward time a rank holding ``pieces`` can run before it frees memory: at most m
    forwards of each piece within ``room`` bytes, a fractional knapsack (the most time per
    byte first), an upper bound on any whole choice."""
    m, work = ranks.m, 0.0
    items = []
    for lo, hi in pieces:
        t = ranks.pre_f[hi] - ranks.pre_f[lo]
        mem = ranks.pre_mf[hi] - ranks.pre_mf[lo]
        if mem <= 0:
            work += m * t
        else:
            items.append((t / mem, t, mem))
    for _, t, mem in sorted(items, reverse=True):
        n = min(m, max(room, 0.0) / mem)
        work += n * t
        room -= n * mem
    return work


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of (extra, area) points from the least extra, each next point
    holding less area: where a fractional mix of ways can be (the others are no better)."""
    pts = sorted(points)
    hull: list[tuple[float, float]] = []
    for x, a in pts:
        if hull and a >= hull[-1][1]:
            continue  # costs more, saves nothing
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                  >= (a - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()  # on or above the segment from the one before to this one
        hull.append((x, a))
    return hull


def rank_pieces(counts: tuple[int, ...], placement: Placement) -> list[list[tuple[int, int]]]:
    """Per rank, its unit ranges ``[lo, hi)`` in model order, of the cut ``counts`` (units per stage)."""
    bounds = [(lo, lo + k) for lo, k in zip(itertools.accumulate((0, *counts)), counts)]
    if placement == "one":
        return [[b] for b in bounds]
    S = len(counts)
    return [[bounds[r], bounds[S - 1 - r]] for r in range(S // 2)]


def _prefix(xs: list[float]) -> list[float]:
    return [0.0, *itertools.accumulate(xs)]
