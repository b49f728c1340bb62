"""``plan``: the cut of the units into stages, the placement and the schedule, chosen together.

A plan goes through named phases, one after the other, all on one ``Clock`` (``plan`` reads
them top to bottom):

1. ``price_cuts``: every cut of a placement where there are at most ``ENUMERATE``, else
   those a local search over the per-cut bounds visits from the baselines' cuts and the most
   balanced one (``search.Cuts``). A cut is priced by its *key*, the solver's quick bound for
   it under its per-rank limit; one whose parameters, gradients, optimizer state and one
   microbatch's activations exceed the budget on some rank has no schedule and is left out.
2. ``bound_unpriced``, the bound (``Search.lower``): over a placement whose every cut was
   priced, the least over its feasible cuts of the best bound known for each (its key, or the
   solver's where it solved the cut, which solves raise as they go); over another, the least
   over every cut of the per-rank bounds that depend on a rank's own units and where the
   stages after it end (``relaxation.relaxed_bound``). The bound holds over every cut of the
   placements searched and every schedule within the budget; every phase below reads it
   (``Search``), and stops once the best value found meets it.
3. ``solve_baselines``: the even split, torchtitan's default and Megatron's, each solved with
   the solver at the same budget (a cut two rules share, once). Where the units hold
   expert-parallel all-to-all, DualPipeV too, as DeepSeek runs it (its order and its
   overlapped pairs), on each V baseline cut where it fits the budget; a cut whose solve did
   not beat it is solved again, at least long enough to take it among its candidates.
4. ``best_first``: cuts solved in order of their key, briefly (the solver's heuristics; with
   recomputation its MILP windows too, which decide what to recompute far better), until the
   next key reaches the best value found, or the phase's time is up. A cut that improves the
   best adds its neighbours.
5. ``polish``: the best few cuts again with the full solver (MILP windows where ``milp``),
   each only while its own bound is below the best value.
6. ``compare``: the best cut found, its schedule with the ``partition`` section: the bound,
   the gap and every baseline's outcome.

Every value is the simulator's on the composed stage costs. Where the units hold
expert-parallel all-to-all (a mixture-of-experts model's ``a_f`` and ``a_b``), every cut's
stage profile holds its units' (``compose``), so the solver chooses overlapped pairs on it, with
DualPipeV's order and pairs among its candidates wherever they fit, and every bound holds for
schedules with pairs (``relaxation``, ``zbsearch.bounds``). Recomputation (``recompute``):
every cut, baselines included, is composed with its units' recomputation costs and solved
with the solver's ``recompute``; its memory need counts what a checkpointed microbatch keeps,
its bounds hold for every choice of what to recompute that the mode allows (``search``), so
the plan's bound does too.

The time limit bounds the whole call: each phase ends at its share of it (pricing every cut
may take until half of it, the later phases then sharing what is left), every solve is
given no more than the time left to its phase's end less the most a solve has overrun its
limit so far, and the searching stops a margin before the limit (``Clock``). However short
the limit, one cut is solved. The plan returns sooner once nothing left could improve the
value or the bound: when the best value meets the bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from .. import clock as timing
from ..errors import ZbError
from ..formats.edit import updated
from ..formats.layers import LayerProfile
from ..formats.partition import CutOutcome, Partition
from ..formats.profile import LaneSharing
from ..formats.schedule import Schedule
from ..limits import allowance
from ..solver import Progress, SolveResult, solve
from ..solver.problem import RECOMPUTATIONS
from ..solver.verdict import CLOSED
from .baselines import BaselineCut, baseline_cuts
from .compose import Cut, Placement, activation_need
from .memory import OPTIMIZERS
from .relaxation import relaxed_bound
from .search import CutEval, Cuts

__all__ = ["PlanResult", "plan", "ENUMERATE", "Clock", "PlanInputs", "Search", "price_cuts", "bound_unpriced",
           "solve_baselines", "best_first", "polish", "compare"]

# Cuts of a placement priced one by one when there are at most this many (12 units on 8
# stages: 330); beyond, the local search. Each costs a quick bound: milliseconds.
ENUMERATE = 3000
# Shares of the time limit, each phase ending at its share of it: pricing cuts, solving the
# baselines, best-first quick solves; the rest polishes the best cuts. Pricing every cut of a
# placement (at most ENUMERATE) may take until _ENUMERATE of it, the phases after it then
# sharing what is left in the same proportions.
_PRICE, _BASELINES, _QUICK = 0.15, 0.2, 0.35
_ENUMERATE = 0.5
# The bound over a placement whose cuts were not all priced may take this share of the limit
# (``relaxation``), else it falls back to the busiest rank's work.
_RELAX = 0.05
# Cuts polished with the full solver at the end, and how close to the best a quick value must be.
_POLISH, _POLISH_WITHIN = 3, 0.03
# The time limit less this share of it (at least _MARGIN_S) is when the plan's work must end:
# what follows (the partition section, the schedule built again with it) is kept back too.
_MARGIN, _MARGIN_S = 0.02, 0.2
# The least a solve is given, and the least worth starting once a plan is in hand.
_MIN_SOLVE_S = 0.05
# What the solve of a cut DualPipeV beats is given, however short the limit: enough to build and
# time the classic schedules, DualPipeV among them, so the plan is never slower than it.
_DUALPIPE_S = 0.5


@dataclass
class Clock:
    """The plan's one time limit and the instants derived from it (``deadline.now()``).

    ``end`` is when the searching must stop: the limit less a margin. Each phase ends at its
    share of the limit (``until``; after pricing, ``phase_end``), no later than ``end``. A
    solve is given at most the time left to the instant it must end by, less the most any
    solve has run over its limit so far (``overrun``): the solver keeps to its limit within its
    own setup and hand-over."""

    start: float
    limit: float
    overrun: float = 0.0
    priced: float | None = None  # when pricing ended

    @property
    def end(self) -> float:
        """When the plan's work must be done."""
        return self.start + self.limit - max(_MARGIN * self.limit, _MARGIN_S)

    def now(self) -> float:
        """The clock every phase reads."""
        return timing.now()

    def until(self, share: float) -> float:
        """The instant ``share`` of the limit after the start, no later than ``end``."""
        return min(self.end, self.start + share * self.limit)

    def phase_end(self, share: float) -> float:
        """When a phase after pricing that ends at ``share`` of the limit ends: at its share,
        or, where pricing ran past its own (every cut priced), as far into what is left as its
        share is into what follows pricing."""
        priced = self.start if self.priced is None else self.priced
        later = priced + (self.end - priced) * (share - _PRICE) / (1 - _PRICE)
        return min(self.end, max(self.until(share), later))

    def seconds(self, wanted: float, by: float | None = None) -> float:
        """What a solve asking for ``wanted`` seconds may have so as to end by ``by`` (default:
        ``end``), its overrun counted; 0 when nothing is left."""
        left = min(self.end if by is None else by, self.end) - self.now() - self.overrun
        return max(0.0, min(wanted, left))

    def solved(self, asked: float, took: float) -> None:
        """Note that a solve given ``asked`` seconds took ``took``."""
        self.overrun = max(self.overrun, took - asked)


@dataclass
class PlanResult:
    """What ``plan`` returns: the schedule (with its ``partition`` section) and how it was found."""

    schedule: Schedule
    partition: Partition
    cut: Cut

    def __repr__(self) -> str:
        p = self.partition
        return (f"PlanResult({self.cut}, value={p.value:.6g} ms, bound={p.lower_bound:.6g} ms, gap={p.gap:.2%}, "
                f"{p.cuts_solved} cuts solved)")


@dataclass(frozen=True)
class PlanInputs:
    """What is planned, checked (``PlanInputs.make``): the arguments of ``plan``."""

    layers: LayerProfile
    num_ranks: int
    m: int
    budget: float | None
    placements: list[Placement]
    optimizer: str
    objective: str
    milp: bool
    recompute: str
    data_parallel: tuple[int, float] | None
    shard: int | None = None
    sharing: LaneSharing | None = None

    @classmethod
    def make(cls, layers: LayerProfile, num_ranks: int, m: int, budget: float | None, placement: str, optimizer: str,
             objective: str | None, milp: bool, recompute: str, data_parallel: tuple[int, float] | None,
             shard: int | None = None, sharing: LaneSharing | None = None) -> PlanInputs:
        """The inputs, or one line (``ZbError``) for the first that is wrong."""
        if objective is None:
            objective = "iteration" if data_parallel is not None else "span"
        if data_parallel is not None and (data_parallel[0] < 1 or not data_parallel[1] > 0):
            raise ZbError("data parallelism needs at least 1 replica and a positive bandwidth")
        if sharing is not None and data_parallel is None:
            raise ZbError("how the reductions share a link needs the data parallelism (replicas and bandwidth) whose "
                          "reductions share it")
        if objective == "iteration" and data_parallel is None:
            raise ZbError("objective 'iteration' needs the data parallelism (replicas and bandwidth) whose reductions "
                          "end it")
        places = _placements(placement, layers, num_ranks)
        if optimizer not in OPTIMIZERS:
            raise ZbError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if m < 1:
            raise ZbError("the number of microbatches must be at least 1")
        if budget is not None and not (math.isfinite(budget) and budget > 0):
            raise ZbError("the memory budget must be a positive number of bytes")
        if objective not in ("span", "makespan", "iteration"):
            raise ZbError(f"objective must be 'span', 'makespan' or 'iteration', not {objective!r}")
        _check_recompute(layers, recompute)
        return cls(layers, num_ranks, m, budget, places, optimizer, objective, milp, recompute, data_parallel, shard,
                   sharing)

    def cuts(self, placement: Placement) -> Cuts:
        """The cuts of ``placement``, priced on demand."""
        return Cuts(self.layers, self.num_ranks, placement, self.m, self.budget, self.optimizer, self.objective,
                    self.recompute, self.data_parallel, self.shard, self.sharing)

    def baselines(self) -> list[tuple[Placement, BaselineCut]]:
        """Every baseline rule of every placement searched, in order."""
        return [(pl, b) for pl in self.placements for b in baseline_cuts(self.layers, self.num_ranks, pl)]


@timing.with_work_clock
def plan(
    layers: LayerProfile,
    num_ranks: int,
    num_microbatches: int,
    budget: float | None,
    *,
    placement: str = "auto",
    optimizer: str = "adamw",
    time_limit: float = 60.0,
    objective: str | None = None,
    milp: bool = True,
    recompute: str = "none",
    data_parallel: tuple[int, float] | None = None,
    shard: int | None = None,
    sharing: LaneSharing | None = None,
    progress: Progress | None = None,
    deterministic: bool = False,
) -> PlanResult:
    """The best cut, placement and schedule found within ``time_limit`` seconds.

    Args:
        layers: the per-layer profile.
        num_ranks: pipeline ranks P.
        num_microbatches: microbatches per iteration.
        budget: bytes per rank for parameters, gradients, optimizer state and activations (None:
            unlimited).
        placement: ``one`` (P stages), ``v`` (2P pieces in a V) or ``auto`` (both).
        optimizer: what the static memory counts (``zbsearch.planner.memory``).
        time_limit: seconds for the whole call, every phase within it (one solve at least runs,
            however short the limit); with ``deterministic``, work in nominal seconds
            (``zbsearch.clock``): the same inputs give the same plan on any machine and load.
        objective: ``span``, ``makespan`` or ``iteration``, as for ``solve`` (default: the
            iteration with ``data_parallel``, else the span).
        milp: polish with the solver's MILP windows.
        recompute: ``none``, ``auto`` or ``full``, as for ``solve``: every cut, the baselines
            included, is solved and bounded so; ``auto`` and ``full`` need the units'
            recomputation costs (``zbsearch profile --per-layer --recompute``).
        data_parallel: (replicas, GB/s per rank): every cut's stages end the iteration with the
            all-reduce of their units' gradients (``stage_profile``), so a cut that finishes a
            stage's backwards earlier, or holds fewer bytes on the last rank, can win.
        shard: the stages are sharded (``fully_shard``) over this many data-parallel ranks: the
            static memory counts it (``zbsearch.planner.memory``).
        sharing: with ``data_parallel``, how the lanes of ranks on one link slow each other
            (``zbsearch.reductions.given_sharing``; None: not at all).

    Raises:
        ZbError: bad arguments, or no cut whose memory fits the budget.
    """
    clock = Clock(0.0, time_limit)
    clock.start = clock.now()
    inputs = PlanInputs.make(layers, num_ranks, num_microbatches, budget, placement, optimizer, objective, milp,
                             recompute, data_parallel, shard, sharing)
    if progress is not None:
        progress("pricing cuts", math.inf, 0.0)
    spaces = price_cuts(inputs, clock)
    search = Search(inputs, clock, spaces, bound_unpriced(inputs, spaces, clock), progress)
    outcomes = solve_baselines(search)
    best_first(search)
    polish(search)
    return compare(search, outcomes)


# ---- 1. price cuts ----------------------------------------------------------------------------

def price_cuts(inputs: PlanInputs, clock: Clock) -> dict[Placement, Cuts]:
    """Each placement's cuts, priced: every one where there are at most ``ENUMERATE`` (until
    ``_ENUMERATE`` of the limit at most; ``Cuts.exhaustive`` says whether all were), else a
    local search from the baselines' cuts and the most balanced one, for ``_PRICE`` of the
    limit shared among the placements. Ends the pricing on ``clock`` (``Clock.priced``).

    Raises:
        ZbError: no cut priced fits the budget.
    """
    spaces = {pl: inputs.cuts(pl) for pl in inputs.placements}
    until = clock.until(_ENUMERATE)
    for space in spaces.values():
        if space.total <= ENUMERATE:
            space.price_all(until, clock.now)  # out of time: the local search below, the bound relaxed
    for pl, space in spaces.items():
        if not space.exhaustive:
            deadline = min(clock.end, clock.now() + _PRICE * clock.limit / len(spaces))
            starts = [b.cut.counts for b in baseline_cuts(inputs.layers, inputs.num_ranks, pl) if b.cut is not None]
            for start in dict.fromkeys([*starts, space.balanced()]):
                space.descend(start, deadline, clock.now)
    clock.priced = clock.now()
    if not any(ev.feasible for space in spaces.values() for ev in space.seen.values()):
        raise ZbError(_no_fit(spaces, inputs.budget, inputs.optimizer, inputs.recompute))
    return spaces


# ---- 2. the bound ------------------------------------------------------------------------------

def bound_unpriced(inputs: PlanInputs, spaces: dict[Placement, Cuts], clock: Clock) -> dict[Placement, float]:
    """Per placement whose cuts were not all priced, a bound over every one of its cuts at once
    (``relaxation.relaxed_bound``), within ``_RELAX`` of the limit (else the busiest rank's
    work). A placement whose every cut was priced is bounded by its cuts (``Search.lower``)."""
    i, deadline = inputs, clock.now() + _RELAX * clock.limit
    return {pl: relaxed_bound(i.layers, i.num_ranks, pl, i.m, i.recompute, budget=i.budget, optimizer=i.optimizer,
                              deadline=deadline, objective=i.objective, shard=i.shard)
            for pl, space in spaces.items() if not space.exhaustive}


@dataclass
class Search:
    """The cuts priced and solved so far, the best found and the bound: what the phases after
    pricing read and improve.

    Each solve goes through ``solve``, which keeps the cut's best result on its ``CutEval``
    (``result``) and raises its bound (``bound``); ``lower`` is the bound over every cut as
    it stands, ``closed`` whether the best value meets it."""

    inputs: PlanInputs
    clock: Clock
    spaces: dict[Placement, Cuts]
    relaxed: dict[Placement, float]  # the bound over a placement not every cut of which was priced
    progress: Progress | None = None
    best: CutEval | None = None

    @property
    def best_value(self) -> float:
        """The best value found (inf before any schedule)."""
        return math.inf if self.best is None or self.best.result is None else self.best.result.info.value

    def feasible(self) -> list[CutEval]:
        """Every cut priced that fits the budget, placement by placement."""
        return [ev for space in self.spaces.values() for ev in space.seen.values() if ev.feasible]

    def solved(self) -> list[CutEval]:
        """Every cut with a schedule."""
        return [ev for ev in self.feasible() if ev.result is not None]

    def lower(self) -> float:
        """The bound over every cut of the placements searched and every schedule, as it stands
        (see the module)."""
        return min(min((ev.bound for ev in space.seen.values() if ev.feasible), default=math.inf)
                   if space.exhaustive else self.relaxed[pl] for pl, space in self.spaces.items())

    def closed(self) -> bool:
        """Whether the best value found is proven: no cut and no schedule can beat it."""
        return self.best_value <= self.lower() * (1 + CLOSED)

    def worth(self, ev: CutEval) -> bool:
        """Whether solving ``ev`` (again) could beat the best value or raise the bound."""
        return not self.closed() and self.best_value > ev.bound * (1 + CLOSED)

    def report(self, phase: str) -> None:
        """Tell the progress callback the phase, the best value and the bound."""
        if self.progress is not None:
            self.progress(phase, self.best_value, min(self.lower(), self.best_value))

    def solve(self, ev: CutEval, seconds: float, full: bool, start: list | None = None) -> SolveResult | None:
        """The solver on one cut, given ``seconds`` (at least ``_MIN_SOLVE_S``), under its per-rank
        limits, with MILP windows where ``full`` and the plan allows them; None where no
        schedule fits. The cut keeps its best result and the larger bound, and the best cut
        is updated."""
        assert ev.profile is not None
        i = self.inputs
        given = max(seconds, _MIN_SOLVE_S)
        t = self.clock.now()
        try:
            res = solve(ev.profile, i.m, ev.limit, chunks=ev.cut.chunks, time_limit=given, milp=full and i.milp,
                        objective=i.objective, recompute=i.recompute, start=start)  # type: ignore[arg-type]
        except ZbError:
            res = None
        self.clock.solved(given, self.clock.now() - t)
        ev.solved = True
        if res is None:
            return None
        ev.bound = max(ev.bound, res.info.lower_bound)
        if ev.result is None or res.info.value < ev.result.info.value:
            ev.result = res
        if res.info.value < self.best_value:
            self.best = ev
        return res


# ---- 3. the baselines -------------------------------------------------------------------------

def solve_baselines(search: Search) -> list[CutOutcome]:
    """Each baseline rule's cut solved at the plan's budget, with the full solver, sharing the
    phase's time (at least 0.2 s each, however short; once one has a schedule, a baseline is
    left unsolved when no time is left); a cut two rules share is solved once. Returns one
    outcome per rule, in order: its value and bound, or why it has none."""
    clock, layers = search.clock, search.inputs.layers
    rules = search.inputs.baselines()
    until = clock.phase_end(_PRICE + _BASELINES)
    cuts = {(pl, b.cut.counts): search.spaces[pl].evaluate(b.cut.counts) for pl, b in rules if b.cut is not None}
    runnable = [ev for ev in cuts.values() if ev.feasible]
    outcomes = []
    for pl, b in rules:
        name = b.name if len(search.inputs.placements) == 1 else f"{b.name} ({pl})"
        if b.cut is None:
            outcomes.append(CutOutcome(name=name, placement=pl, units_per_stage=[], layers_per_stage=[], note=b.note))
            continue
        ev = cuts[(pl, b.cut.counts)]
        if not ev.feasible:
            outcomes.append(_outcome(name, layers, ev, f"over the budget: a rank needs {ev.over:.4g} bytes more than it "
                                                       "has, for one microbatch's activations"))
            continue
        if not ev.solved:
            left = sum(not x.solved for x in runnable)
            seconds = clock.seconds(max(0.2, (until - clock.now()) / left))
            if seconds < _MIN_SOLVE_S and search.best is not None:
                outcomes.append(_outcome(name, layers, ev, "not solved: the time limit was spent"))
                continue
            search.report(f"solving baseline {name}")
            search.solve(ev, seconds, True)
        outcomes.append(_outcome(name, layers, ev, None if ev.result is not None else "no schedule within the budget"))
    if layers.has_all_to_all:  # what a hand-made MoE schedule gives on the same cuts
        for pl, b in rules:
            if pl == "v" and b.cut is not None:
                outcomes.append(_dualpipe_v(search, b.name, cuts[(pl, b.cut.counts)]))
    return outcomes


def _dualpipe_v(search: Search, rule: str, ev: CutEval) -> CutOutcome:
    """DualPipeV on a V baseline cut, as DeepSeek runs it (its order, its overlapped pairs),
    timed on the plan's objective, or why it has no value (over the budget, too few microbatches)."""
    from ..solver.baselines import CLASSIC_BY_CHUNKS, classic_baselines

    name, layers = f"dualpipe-v ({rule} cut)", search.inputs.layers
    if not ev.feasible:
        return _outcome(name, layers, ev, "over the budget: one microbatch's activations do not fit")
    assert ev.profile is not None
    m = search.inputs.m
    if m < 2 * ev.cut.num_ranks:
        return _outcome(name, layers, ev, f"DualPipeV needs at least {2 * ev.cut.num_ranks} microbatches")
    got, _ = classic_baselines(ev.profile, m, ev.limit, 2, search.inputs.objective,  # type: ignore[arg-type]
                               skip=[k for k in CLASSIC_BY_CHUNKS[2] if k != "dualpipe-v"])
    if not got:
        return _outcome(name, layers, ev, "over the budget: its activations do not fit")
    base = got[0]
    if ev.result is None or ev.result.info.value > base.value:
        # the cut's solve, which takes DualPipeV among its candidates, so that the plan is never slower
        search.report(f"solving {ev.cut} from DualPipeV")
        search.solve(ev, _DUALPIPE_S, False)
    kinds = [u.kind for u in layers.units]
    return CutOutcome(
        name=name, placement="v", units_per_stage=list(ev.cut.counts),
        layers_per_stage=[sum(k == "layer" for k in kinds[lo:hi]) for lo, hi in ev.cut.bounds], value=base.value,
        peak_bytes=[s + a for s, a in zip(ev.static, base.timeline.peak_memory)],
        overlapped_pairs=sum(map(len, base.pairs or [])),
        note="its own order and pairs, not solved")


# ---- 4. best first ----------------------------------------------------------------------------

def best_first(search: Search) -> None:
    """Cuts in order of their key, each solved briefly (the heuristics; with recomputation MILP
    windows too), until the next key reaches the best value, the phase's time is up (once a
    schedule is in hand) or the best value is proven. A cut that improves the best adds its
    neighbours (one unit moved across one boundary).

    Raises:
        ZbError: no cut has a schedule within the budget.
    """
    clock, recompute = search.clock, search.inputs.recompute
    until = max(clock.now(), clock.phase_end(_PRICE + _BASELINES + _QUICK))
    feasible = search.feasible()
    heap = [(ev.key, str(ev.cut), ev) for ev in feasible]
    heapq.heapify(heap)
    quick = _quick_time(feasible[0], search.inputs.m, clock.limit, recompute)
    while heap and (clock.now() < until or search.best is None) and not (search.best is not None and search.closed()):
        key, name, ev = heap[0]
        if key >= search.best_value * (1 - 1e-9):
            break  # no cut left can beat the best
        heapq.heappop(heap)
        if ev.solved:
            continue
        seconds = clock.seconds(quick, until)
        if seconds < _MIN_SOLVE_S and search.best is not None:
            break
        search.report(f"solving {ev.cut}")
        search.solve(ev, seconds, recompute != "none")  # the heuristics alone recompute poorly: MILP windows too
        if search.best is ev:  # a new best (it was not solved before): its neighbours may be better still
            space = search.spaces[ev.cut.placement]
            for nb in space.neighbours(ev.cut.counts, (1,)):
                nev = space.evaluate(nb)
                if nev.feasible and not nev.solved:
                    heapq.heappush(heap, (nev.key, str(nev.cut), nev))
    if search.best is None:
        raise ZbError(_no_schedule(feasible, search.inputs.budget, recompute))


# ---- 5. polish --------------------------------------------------------------------------------

def polish(search: Search) -> None:
    """The best few cuts (``_POLISH``, within ``_POLISH_WITHIN`` of the best) solved again with
    the full solver from their schedule, sharing what is left of the time; a cut only while
    its own bound is below the best value and the best is not proven."""
    clock = search.clock
    ranked = sorted(search.solved(), key=lambda ev: _value(ev))
    top = [ev for ev in ranked if _value(ev) <= _value(ranked[0]) * (1 + _POLISH_WITHIN)][:_POLISH]
    for i, ev in enumerate(top):
        if not search.worth(ev):  # proven: nothing polishing it could change
            continue
        seconds = clock.seconds((clock.end - clock.now()) / (len(top) - i))
        if seconds < 0.2 and (i or seconds < _MIN_SOLVE_S):
            break
        search.report(f"polishing {ev.cut}")
        assert ev.result is not None
        search.solve(ev, seconds, True, start=ev.result.schedule.rank_actions)


# ---- 6. compare -------------------------------------------------------------------------------

def compare(search: Search, outcomes: list[CutOutcome]) -> PlanResult:
    """The best cut's schedule with its ``partition`` section: the bound over every cut (never
    above the value), the gap, and the baselines' outcomes."""
    i, best = search.inputs, search.best
    assert best is not None and best.result is not None
    res = best.result
    value = res.info.value
    bound = min(search.lower(), value)
    if search.progress is not None:
        search.progress("done", value, bound)
    part = Partition(
        layers=i.layers.name, units=i.layers.names, kinds=[u.kind for u in i.layers.units], placement=best.cut.placement,
        stages=best.cut.names(i.layers), optimizer=i.optimizer, shard=i.shard, budget_bytes=i.budget, static_bytes=best.static,
        activation_bytes=list(res.timeline.peak_memory), objective=i.objective, recompute=i.recompute, value=value,
        lower_bound=bound, gap=max(0.0, value / bound - 1) if bound > 0 else 0.0, placements_searched=list(i.placements),
        cuts_solved=len(search.solved()), cuts_bounded=sum(len(s.seen) for s in search.spaces.values()),
        exhaustive=all(s.exhaustive for s in search.spaces.values()),
        time_s=round(search.clock.now() - search.clock.start, 3), clock=timing.kind(), baselines=outcomes,
    )
    return PlanResult(updated(res.schedule, partition=part), part, best.cut)


# ---- helpers ----------------------------------------------------------------------------------

def _value(ev: CutEval) -> float:
    return math.inf if ev.result is None else ev.result.info.value


def _check_recompute(layers: LayerProfile, recompute: str) -> None:
    """One line where the units cannot recompute as ``recompute`` asks."""
    if recompute not in RECOMPUTATIONS:
        raise ZbError(f"recompute must be one of {', '.join(RECOMPUTATIONS)}, not {recompute!r}")
    how = "measure them with zbsearch profile --per-layer --recompute"
    if recompute == "full":
        missing = [u.name for u in layers.units if u.t_r is None or u.m_fc is None]
        if missing:
            raise ZbError(f"--recompute full: per-layer profile {layers.name!r} has no full recomputation costs (t_r, "
                          f"m_fc) for unit {missing[0]!r}; {how}")
    elif recompute == "auto" and not any(
            (u.t_r is not None and u.m_fc is not None) or (u.t_rs is not None and u.m_fs is not None) for u in layers.units):
        raise ZbError(f"--recompute auto: per-layer profile {layers.name!r} has no recomputation costs (t_r and m_fc, "
                      f"or t_rs and m_fs, per unit); {how}")


def _placements(placement: str, layers: LayerProfile, num_ranks: int) -> list[Placement]:
    if num_ranks < 2:
        raise ZbError(f"a pipeline needs at least 2 ranks, not {num_ranks}")
    if placement not in ("one", "v", "auto"):
        raise ZbError(f"placement {placement!r}: use one, v or auto")
    n = layers.num_units
    if placement == "one" or (placement == "auto" and n < 2 * num_ranks):
        if n < num_ranks:
            raise ZbError(f"{n} units cannot fill {num_ranks} stages (one per rank)")
        return ["one"]
    if n < 2 * num_ranks:
        raise ZbError(f"{n} units cannot fill the {2 * num_ranks} pieces of a V on {num_ranks} ranks")
    return ["v"] if placement == "v" else ["one", "v"]


def _quick_time(ev: CutEval, m: int, time_limit: float, recompute: str = "none") -> float:
    """Seconds for one quick solve: enough for the heuristics on this many passes (twice as
    long where the solver also chooses what to recompute, with MILP windows)."""
    passes = 3 * len(ev.cut.counts) * m
    least = 0.1 if recompute == "none" else 0.2
    return min(max(least, passes / (2000 if recompute == "none" else 1000)), max(least, time_limit / 20))


def _outcome(name: str, layers: LayerProfile, ev: CutEval, note: str | None) -> CutOutcome:
    """A baseline's outcome: its cut and, where it was solved, its result (``ev.result``)."""
    kinds = [u.kind for u in layers.units]
    per_layer = [sum(k == "layer" for k in kinds[lo:hi]) for lo, hi in ev.cut.bounds]
    res = ev.result if note is None else None
    return CutOutcome(
        name=name, placement=ev.cut.placement, units_per_stage=list(ev.cut.counts), layers_per_stage=per_layer,
        value=None if res is None else res.info.value, lower_bound=None if res is None else res.info.lower_bound,
        peak_bytes=None if res is None else [s + a for s, a in zip(ev.static, res.timeline.peak_memory)],
        recomputed=0 if res is None else res.info.recomputed,
        overlapped_pairs=0 if res is None else res.info.overlapped_pairs, note=note,
    )


def _no_fit(spaces: dict[Placement, Cuts], budget: float | None, optimizer: str, recompute: str) -> str:
    closest = min((ev for s in spaces.values() for ev in s.seen.values()), key=lambda ev: ev.over)
    need = (budget or 0) + closest.over
    acts = "one microbatch's activations" + ("" if recompute == "none" else ", recomputed")
    hint = "; with --recompute auto some cut fits" if recompute == "none" and _fits_recomputed(spaces.values()) else ""
    return (f"no cut fits a budget of {(budget or 0) / 2**30:.4g} GiB per rank with {optimizer}: the closest, "
            f"{closest.cut}, needs {need / 2**30:.4g} GiB on some rank for its parameters, gradients, optimizer state "
            f"and {acts}{hint}")


def _fits_recomputed(spaces: Iterable[Cuts]) -> bool:
    """Whether some cut priced would fit its limit if its schedule could recompute."""
    for space in spaces:
        if not any(u.recompute() is not None or u.recompute(True) is not None for u in space.layers.units):
            return False
        for ev in space.seen.values():
            if ev.limit is not None and all(
                    x > 0 and n <= allowance(x) for n, x in zip(activation_need(space.layers, ev.cut, "auto"), ev.limit)):
                return True
    return False


def _no_schedule(feasible: list[CutEval], budget: float | None, recompute: str) -> str:
    return (f"no schedule of the {len(feasible)} cuts whose memory fits the budget of {(budget or 0) / 2**30:.4g} GiB "
            f"per rank was found within it" + (" (recompute " + recompute + ")" if recompute != "none" else ""))
