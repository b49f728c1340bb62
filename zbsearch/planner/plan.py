"""``plan``: the cut of the units into stages, the placement and the schedule, chosen together.

1. Price cuts (``search.Cuts``): every cut where there are few enough, else those a local
   search over the solver's per-cut bounds visits from the baselines' cuts and the most
   balanced one. A cut whose parameters, gradients, optimizer state and one microbatch's
   activations exceed the budget on some rank has no schedule and is left out.
2. Solve the baselines (even split, torchtitan's default, Megatron's with the embedding and
   loss counted as layers) with the solver at the same budget.
3. Best first: solve cuts in order of their bound (the solver's heuristics, briefly; with
   recomputation its MILP windows too, which decide what to recompute far better) and stop
   once the next cut's bound reaches the best value found, or at the time set for this phase.
   A cut that improves the best adds its neighbours.
4. Polish the best few cuts with the full solver (MILP windows where ``milp``) and keep the best
   of them and of the baselines.

The bound returned holds over every cut of the placements searched and every schedule within
the budget: where every cut was priced, the least over feasible cuts of the best bound known
for each (the solver's where it solved the cut, its quick bound otherwise); elsewhere the
placement's ``relaxed_bound``. Every value is the simulator's on the composed stage costs.

Recomputation (``recompute``): every cut, baselines included, is composed with its units'
recomputation costs and solved with the solver's ``recompute``; its memory need counts what a
checkpointed microbatch keeps, its bounds hold for every choice of what to recompute that the
mode allows (``search``), so the plan's bound does too.

The time limit bounds the whole call: the phases end at their shares of it (pricing every cut
may take until half of it, the later phases then sharing what is left), every solve is
given no more than the time left to its phase's end less the most a solve has overrun its
limit so far, and the searching stops a margin before the limit (``Clock``). However short
the limit, one cut is solved. It returns sooner once nothing left could improve the value or
the bound: when the best value meets the bound over every cut; and a cut is solved again only
while its own bound is below the best value.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

from ..errors import ZbError
from ..formats.edit import updated
from ..formats.layers import LayerProfile
from ..formats.partition import CutOutcome, Partition
from ..formats.schedule import Schedule
from ..limits import allowance
from ..solver import Progress, SolveResult, solve
from ..solver.problem import RECOMPUTATIONS
from ..solver.verdict import CLOSED
from .baselines import baseline_cuts
from .compose import Cut, Placement, activation_need
from .memory import OPTIMIZERS
from .search import CutEval, Cuts, compositions, relaxed_bound

__all__ = ["PlanResult", "plan", "ENUMERATE", "Clock"]

# Cuts of a placement priced one by one when there are at most this many (12 units on 8
# stages: 330); beyond, the local search. Each costs a quick bound: milliseconds.
ENUMERATE = 3000
# Shares of the time limit, each phase ending at its share of it: pricing cuts, solving the
# baselines, best-first quick solves; the rest polishes the best cuts. Pricing every cut of a
# placement (at most ENUMERATE) may take until _ENUMERATE of it, the phases after it then
# sharing what is left in the same proportions.
_PRICE, _BASELINES, _QUICK = 0.15, 0.2, 0.35
_ENUMERATE = 0.5
# Cuts polished with the full solver at the end, and how close to the best a quick value must be.
_POLISH, _POLISH_WITHIN = 3, 0.03
# The time limit less this share of it (at least _MARGIN_S) is when the plan's work must end:
# what follows (the partition section, the schedule built again with it) is kept back too.
_MARGIN, _MARGIN_S = 0.02, 0.2
# The least a solve is given, and the least worth starting once a plan is in hand.
_MIN_SOLVE_S = 0.05


@dataclass
class Clock:
    """The plan's one time limit and the instants derived from it (``time.monotonic()``).

    ``end`` is when the searching must stop: the limit less a margin. Each phase ends at its
    share of the limit (``until``), no later than ``end``. A solve is given at most the time
    left to the instant it must end by, less the most any solve has run over its limit so far
    (``overrun``): the solver keeps to its limit within its own setup and hand-over."""

    start: float
    limit: float
    overrun: float = 0.0

    @property
    def end(self) -> float:
        """When the plan's work must be done."""
        return self.start + self.limit - max(_MARGIN * self.limit, _MARGIN_S)

    def now(self) -> float:
        """The clock every phase reads."""
        return time.monotonic()

    def until(self, share: float) -> float:
        """The instant ``share`` of the limit after the start, no later than ``end``."""
        return min(self.end, self.start + share * self.limit)

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
    progress: Progress | None = None,
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
            however short the limit).
        objective: ``span``, ``makespan`` or ``iteration``, as for ``solve`` (default: the
            iteration with ``data_parallel``, else the span).
        milp: polish with the solver's MILP windows.
        recompute: ``none``, ``auto`` or ``full``, as for ``solve``: every cut, the baselines
            included, is solved and bounded so; ``auto`` and ``full`` need the units'
            recomputation costs (``zbsearch profile --per-layer --recompute``).
        data_parallel: (replicas, GB/s per rank): every cut's stages end the iteration with the
            all-reduce of their units' gradients (``stage_profile``), so a cut that finishes a
            stage's backwards earlier, or holds fewer bytes on the last rank, can win.

    Raises:
        ZbError: bad arguments, or no cut whose memory fits the budget.
    """
    clock = Clock(0.0, time_limit)
    clock.start = clock.now()
    if objective is None:
        objective = "iteration" if data_parallel is not None else "span"
    if data_parallel is not None and (data_parallel[0] < 1 or not data_parallel[1] > 0):
        raise ZbError("data parallelism needs at least 1 replica and a positive bandwidth")
    if objective == "iteration" and data_parallel is None:
        raise ZbError("objective 'iteration' needs the data parallelism (replicas and bandwidth) whose reductions "
                      "end it")
    return _plan(layers, num_ranks, num_microbatches, budget, placement, optimizer, objective, milp, recompute,
                 progress, clock, data_parallel)


def _plan(layers: LayerProfile, num_ranks: int, m: int, budget: float | None, placement: str, optimizer: str,
          objective: str, milp: bool, recompute: str, progress: Progress | None, clock: Clock,
          data_parallel: tuple[int, float] | None = None) -> PlanResult:
    """``plan`` on ``clock`` (see there)."""
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
    best_value = math.inf
    bound_now = 0.0

    def report(phase: str) -> None:
        if progress is not None:
            progress(phase, best_value, bound_now)

    def run(ev: CutEval, seconds: float, full: bool, start: list | None = None) -> SolveResult | None:
        given = max(seconds, _MIN_SOLVE_S)
        t = clock.now()
        res = _solve(ev, m, given, full and milp, objective, recompute, start)
        clock.solved(given, clock.now() - t)
        return res

    # 1. price cuts: every one where there are at most ENUMERATE (until _ENUMERATE of the limit at
    # most), else a local search for _PRICE of the limit shared among the placements
    spaces = {pl: Cuts(layers, num_ranks, pl, m, budget, optimizer, objective, recompute, data_parallel) for pl in places}
    exhaustive: dict[Placement, bool] = {pl: False for pl in places}
    report("pricing cuts")
    enum_until = clock.until(_ENUMERATE)
    for pl, space in spaces.items():
        if space.total <= ENUMERATE:
            for k, counts in enumerate(compositions(layers.num_units, space.num_stages)):
                if k and clock.now() >= enum_until:  # out of time: the local search below, the bound relaxed
                    break
                space.evaluate(counts)
            else:
                exhaustive[pl] = True
    for pl, space in spaces.items():
        if not exhaustive[pl]:
            share = min(clock.end, clock.now() + _PRICE * clock.limit / len(spaces))
            starts = [b.cut.counts for b in baseline_cuts(layers, num_ranks, pl) if b.cut is not None]
            starts.append(space.balanced())
            for start in dict.fromkeys(starts):
                space.descend(start, share, clock.now)
    feasible = [ev for space in spaces.values() for ev in space.seen.values() if ev.feasible]
    if not feasible:
        raise ZbError(_no_fit(spaces, budget, optimizer, recompute))
    relaxed = {pl: relaxed_bound(layers, num_ranks, pl, m, recompute) for pl in places if not exhaustive[pl]}
    priced = clock.now()

    def lower() -> float:
        """The bound over every cut as it stands (see the module)."""
        return min(min((ev.bound for ev in spaces[pl].seen.values() if ev.feasible), default=math.inf)
                   if exhaustive[pl] else relaxed[pl] for pl in places)

    def closed() -> bool:
        """Whether the best value found is proven: no cut and no schedule can beat it."""
        return best_value <= lower() * (1 + CLOSED)

    def worth(ev: CutEval) -> bool:
        """Whether solving ``ev`` again could beat the best value or raise the bound."""
        return not closed() and best_value > ev.bound * (1 + CLOSED)

    # 2. baselines at the same budget
    outcomes: list[CutOutcome] = []
    base_runs: list[tuple[CutEval, SolveResult]] = []
    rules = [(pl, b) for pl in places for b in baseline_cuts(layers, num_ranks, pl)]
    runnable = [(pl, b) for pl, b in rules if b.cut is not None and spaces[pl].evaluate(b.cut.counts).feasible]
    base_until = _phase_end(clock, priced, _PRICE + _BASELINES)
    left_to_run = len(runnable)
    for pl, b in rules:
        name = b.name if len(places) == 1 else f"{b.name} ({pl})"
        if b.cut is None:
            outcomes.append(CutOutcome(name=name, placement=pl, units_per_stage=[], layers_per_stage=[], note=b.note))
            continue
        ev = spaces[pl].evaluate(b.cut.counts)
        if not ev.feasible:
            outcomes.append(_outcome(name, layers, ev, None, f"over the budget: a rank needs {ev.over:.4g} bytes more "
                                                             "than it has, for one microbatch's activations"))
            continue
        seconds = clock.seconds(max(0.2, (base_until - clock.now()) / left_to_run))
        left_to_run -= 1
        if seconds < _MIN_SOLVE_S and base_runs:
            outcomes.append(_outcome(name, layers, ev, None, "not solved: the time limit was spent"))
            continue
        report(f"solving baseline {name}")
        res = run(ev, seconds, True)
        if res is None:
            outcomes.append(_outcome(name, layers, ev, None, "no schedule within the budget"))
            continue
        base_runs.append((ev, res))
        outcomes.append(_outcome(name, layers, ev, res, None))
        best_value = min(best_value, res.info.value)

    # 3. best first, quick solves
    quick_until = max(clock.now(), _phase_end(clock, priced, _PRICE + _BASELINES + _QUICK))
    results: dict[tuple[Placement, tuple[int, ...]], SolveResult] = {}
    for ev, res in base_runs:
        results[(ev.cut.placement, ev.cut.counts)] = res
    heap = [(ev.key, str(ev.cut), ev) for ev in feasible]
    heapq.heapify(heap)
    quick_t = _quick_time(feasible[0], m, clock.limit, recompute)
    solved_keys: set[tuple[Placement, tuple[int, ...]]] = set(results)
    while heap and (clock.now() < quick_until or not results) and not (results and closed()):
        key, _, ev = heapq.heappop(heap)
        if key >= best_value * (1 - 1e-9):
            heapq.heappush(heap, (key, str(ev.cut), ev))
            break
        ident = (ev.cut.placement, ev.cut.counts)
        if ident in solved_keys:
            continue
        seconds = clock.seconds(quick_t, quick_until)
        if seconds < _MIN_SOLVE_S and results:
            heapq.heappush(heap, (key, str(ev.cut), ev))
            break
        solved_keys.add(ident)
        report(f"solving {ev.cut}")
        res = run(ev, seconds, recompute != "none")  # the heuristics alone recompute poorly: MILP windows too
        if res is None:
            continue
        results[ident] = res
        if res.info.value < best_value:
            best_value = res.info.value
            space = spaces[ev.cut.placement]
            for nb in space.neighbours(ev.cut.counts, (1,)):
                nev = space.evaluate(nb)
                if nev.feasible and (nev.cut.placement, nb) not in solved_keys:
                    heapq.heappush(heap, (nev.key, str(nev.cut), nev))
    if not results:
        raise ZbError(_no_schedule(feasible, budget, recompute))

    # 4. polish the best few with the full solver
    ranked = sorted(results.items(), key=lambda kv: kv[1].info.value)
    top = [kv for kv in ranked if kv[1].info.value <= ranked[0][1].info.value * (1 + _POLISH_WITHIN)][:_POLISH]
    for i, (ident, res) in enumerate(top):
        ev = spaces[ident[0]].evaluate(ident[1])
        if not worth(ev):  # proven: nothing polishing it could change
            continue
        share = clock.seconds((clock.end - clock.now()) / (len(top) - i))
        if share < 0.2 and (i or share < _MIN_SOLVE_S):
            break
        report(f"polishing {ev.cut}")
        better = run(ev, share, True, start=res.schedule.rank_actions)
        if better is not None:
            ev.bound = max(ev.bound, better.info.lower_bound)
            if better.info.value < res.info.value:
                results[ident] = better
                best_value = min(best_value, better.info.value)

    # choose, and bound every cut
    ident, res = min(results.items(), key=lambda kv: kv[1].info.value)
    for (pl, counts), r in results.items():
        ev = spaces[pl].evaluate(counts)
        ev.bound = max(ev.bound, r.info.lower_bound)
        ev.value = r.info.value if ev.value is None else min(ev.value, r.info.value)
    value = res.info.value
    bound = min(lower(), value)
    bound_now = bound
    best_value = value
    report("done")
    ev = spaces[ident[0]].evaluate(ident[1])
    tl = res.timeline
    part = Partition(
        layers=layers.name, units=layers.names, kinds=[u.kind for u in layers.units], placement=ev.cut.placement,
        stages=ev.cut.names(layers), optimizer=optimizer, budget_bytes=budget, static_bytes=ev.static,
        activation_bytes=list(tl.peak_memory), objective=objective, recompute=recompute, value=value, lower_bound=bound,
        gap=max(0.0, value / bound - 1) if bound > 0 else 0.0, placements_searched=list(places),
        cuts_solved=len(results), cuts_bounded=sum(len(s.seen) for s in spaces.values()),
        exhaustive=all(exhaustive.values()), time_s=round(clock.now() - clock.start, 3), baselines=outcomes,
    )
    sched = updated(res.schedule, partition=part)
    return PlanResult(sched, part, ev.cut)


def _phase_end(clock: Clock, priced: float, share: float) -> float:
    """When the phase that ends at ``share`` of the limit ends, pricing having ended at
    ``priced``: at its share, or where pricing ran past its own share (every cut priced), as
    far into what is left as its share is into what follows pricing."""
    later = priced + (clock.end - priced) * (share - _PRICE) / (1 - _PRICE)
    return min(clock.end, max(clock.until(share), later))


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


def _solve(ev: CutEval, m: int, seconds: float, milp: bool, objective: str, recompute: str,
           start: list | None = None) -> SolveResult | None:
    """The solver on one cut under its per-rank limits; None where no schedule fits."""
    assert ev.profile is not None
    try:
        res = solve(ev.profile, m, ev.limit, chunks=ev.cut.chunks, time_limit=seconds, milp=milp,
                    objective=objective, recompute=recompute, start=start)  # type: ignore[arg-type]
    except ZbError:
        return None
    ev.solves.append(res.info.value)
    ev.bound = max(ev.bound, res.info.lower_bound)
    return res


def _outcome(name: str, layers: LayerProfile, ev: CutEval, res: SolveResult | None, note: str | None) -> CutOutcome:
    kinds = [u.kind for u in layers.units]
    per_layer = [sum(k == "layer" for k in kinds[lo:hi]) for lo, hi in ev.cut.bounds]
    return CutOutcome(
        name=name, placement=ev.cut.placement, units_per_stage=list(ev.cut.counts), layers_per_stage=per_layer,
        value=None if res is None else res.info.value, lower_bound=None if res is None else res.info.lower_bound,
        peak_bytes=None if res is None else [s + a for s, a in zip(ev.static, res.timeline.peak_memory)],
        recomputed=0 if res is None else res.info.recomputed, note=note,
    )


def _no_fit(spaces: dict[Placement, Cuts], budget: float | None, optimizer: str, recompute: str) -> str:
    closest = min((ev for s in spaces.values() for ev in s.seen.values()), key=lambda ev: ev.over)
    need = (budget or 0) + closest.over
    acts = "one microbatch's activations" + ("" if recompute == "none" else ", recomputed")
    hint = "; with --recompute auto some cut fits" if recompute == "none" and _fits_recomputed(spaces) else ""
    return (f"no cut fits a budget of {(budget or 0) / 2**30:.4g} GiB per rank with {optimizer}: the closest, "
            f"{closest.cut}, needs {need / 2**30:.4g} GiB on some rank for its parameters, gradients, optimizer state "
            f"and {acts}{hint}")


def _fits_recomputed(spaces: dict[Placement, Cuts]) -> bool:
    """Whether some cut priced would fit its limit if its schedule could recompute."""
    for space in spaces.values():
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
