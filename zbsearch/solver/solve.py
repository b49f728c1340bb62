"""``solve``: the least-bubble schedule under a memory limit, with an honest gap.

Each microbatch's backward on each stage may run fused (one BW) or split (B, then W later);
where a fused one costs less (``CostModel.fusing_may_pay``) every phase ranges over both.

1. Construct: every ``candidate_policies`` list schedule (split, and where fusing pays fused
   but for a cool-down tail), the best few of them with their wait knobs refined
   (``refine_waits``), plus the classic and sequential ones, on the true per-stage costs (or,
   with ``uniform_costs``, on their median across stages as the paper's scheduler does, to show
   what per-stage costs buy). The best few by their own timing are simulated and the best
   kept. Then every classic schedule within the limit (``baselines``) is a candidate too, and
   where fusing may pay the best is also tried with its adjacent B, W fused and with every
   backward fused.
2. Prove: the lower bound is the largest of the one-machine bounds over any rank's passes
   (per pass type, and per pass with microbatch order and memory precedences) and the
   memory-aware idle bound (``zbsearch.bounds``, on costs no fused or split schedule beats);
   on small problems the exact MILP, which chooses fused or split per backward, may also raise
   it or close it. A classic schedule on another placement (interleaved 1F1B) caps it: the
   bound covers it too.
3. Improve: a local search over per-rank orders and fused or split backwards
   (``local_search``: non-FIFO orders too, judged by simulation) for a share of the time, before
   and after the exact MILP; then MILP windows (``milp.improve``) until the gap closes or the
   time limit.
4. Check: the final schedule is validated by the core validator, memory limit included,
   before anything is returned; ``verdict`` says what it means.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..actions import Action, Op
from ..bounds import memory_makespan_lower_bound, memory_span_lower_bound
from ..classic import KINDS
from ..costs import CostModel
from ..errors import ZbError
from ..formats.edit import updated
from ..formats.profile import Profile
from ..formats.schedule import Schedule, SolverInfo
from ..layout import placement
from ..limits import parse_memory_limit
from ..prediction import with_prediction
from ..simulator import Timeline
from ..validator import validate
from .baselines import Baseline, classic_baselines
from .feasibility import check_limit
from .heuristic import Policy, candidate_policies, list_schedule, refine_waits, sequential_schedule
from .local_search import local_search
from .problem import Objective, Problem
from .verdict import CLOSED as _CLOSED
from .verdict import decide_status

__all__ = ["SolverInfo", "SolveResult", "Progress", "progress_text", "solve", "uniform_profile", "solver_placement"]

# Problems up to this many passes get the exact MILP first: it can prove optimality.
_EXACT_PASSES = 120
# Shares of the time left that the local search over orders may take: after the construction
# (it often closes the gap quickly) and after the exact MILP. Beyond the exact MILP's size each
# candidate costs a simulation of hundreds of passes, so the MILP windows, which improve many
# passes at once, get most of the time, and beyond _SEARCH_PASSES nearly all of it.
_SEARCH_SHARE = (0.25, 0.5)
_SEARCH_SHARE_LARGE = 0.1
_SEARCH_PASSES = 2000
# List-scheduling policies of distinct structure whose wait knobs ``_construct`` refines, in at
# most this many times as long as the grid took: the refinement is worth a second look at the
# best few, not at all.
_REFINED = 3
_REFINE_TIME = 3.0
# Starts of the first local search on problems beyond the exact MILP's size: the best
# construction and the best of up to two other origins, each with the search's share of the
# time left. A start whose waits are tightly phased (a refined one) can sit in a local optimum
# that single moves do not leave while a slightly worse one leads further.
_STARTS = 3


@dataclass
class SolveResult:
    """What ``solve`` returns.

    Attributes:
        schedule: the best schedule found, validated, with its prediction and ``solver`` block.
        info: how it was found and how good it is: value, lower bound, gap, status.
        timeline: the schedule simulated on the profile's costs.
    """

    schedule: Schedule
    info: SolverInfo
    timeline: Timeline

    def __repr__(self) -> str:
        i = self.info
        return (f"SolveResult({self.schedule.kind!r}, value={i.value:.6g} ms, bound={i.lower_bound:.6g} ms, "
                f"gap={i.gap:.2%}, status={i.status}, {i.time_s:.1f} s)")


Progress = Callable[[str, float, float], None]  # (phase, best value, lower bound)


def progress_text(phase: str, value: float, bound: float) -> str:
    """One line for a progress display: the phase, the best value so far and the bound with the
    gap between them (each where known: value inf before the first schedule, bound 0 before any)."""
    best = f": best {value:.6g} ms" if value < float("inf") else ""
    gap = f", gap {value / bound - 1:.2%}" if bound > 0 and value < float("inf") else ""
    return f"{phase}{best}" + (f", bound {bound:.6g} ms{gap}" if bound > 0 else "")


def solver_placement(num_ranks: int, chunks: int) -> list[int]:
    """The placements the solver supports: one stage per rank, or the V (two chunks)."""
    if chunks not in (1, 2):
        raise ZbError(f"the solver places one stage per rank or two in a V (chunks 1 or 2), not {chunks} chunks")
    return placement(num_ranks, chunks, "v")


def uniform_profile(profile: Profile) -> Profile:
    """Every stage with the median F, B and W time across stages (memory stays per stage), and
    the median fused backward and forward where the profile has them."""
    med = {k: statistics.median(getattr(st, k) for st in profile.stages) for k in ("t_f", "t_b", "t_w")}
    if any(st.t_bw is not None for st in profile.stages):
        med["t_bw"] = statistics.median(st.fused_backward for st in profile.stages)
    if any(st.t_ff is not None for st in profile.stages):
        med["t_ff"] = statistics.median(st.fused_forward for st in profile.stages)
    stages = [updated(st, **med) for st in profile.stages]
    return updated(profile, stages=stages, name=f"{profile.name}-uniform")


# Handcrafted orders tried as further candidates, by placement; the least bubble first (when time
# is short only the first within the memory limit is timed: ZB-H2 needs about 2p, ZB-H1 1p).
_CLASSIC_CANDIDATES = {1: ("zb-h2", "zb-h1", "1f1b-split"), 2: ("zb-v",)}


def _classic_kinds(problem: Problem) -> tuple[str, ...]:
    """The handcrafted schedules that apply to the placement, as further candidates."""
    c = problem.cost
    chunks = c.num_stages // c.num_ranks
    if chunks not in _CLASSIC_CANDIDATES or list(c.stage_to_rank) != placement(c.num_ranks, chunks, "v"):
        return ()
    return _CLASSIC_CANDIDATES[chunks]


def _same(rows: list[list[Action]]) -> list[list[Action]]:
    return rows


def _construct(
    problem: Problem, deadline: float, hard: float, start=None, keep: int = 3, grid: float | None = None,
    report: Callable[[float], None] | None = None, target: float = float("-inf"),
    built: dict[str, tuple[list[list[Action]], Timeline | None]] | None = None,
) -> tuple[str, list[list[Action]], Timeline, float, list[list[list[Action]]]]:
    """Best of the given start, the list-scheduling grid (ordered most-promising first; ranked
    by their own timing, only the best few simulated; the best ``_REFINED`` structures with
    their wait knobs refined, within the grid's deadline), the classic schedules and the
    sequential one, as far as ``deadline`` allows: once it has passed, the first candidate
    within the limit is kept (the sequential schedule, last, always is: it needs the least
    memory of any schedule). Until one list schedule is found the grid runs to ``hard`` (the
    solve's deadline less what its end needs), where a list schedule still running is cut: then
    the first classic schedule within the limit (built in milliseconds), or else the sequential
    one, is kept. ``grid``: when the grid stops once one list schedule is found (default
    ``deadline``). ``report`` hears each better list schedule's value by its own timing (never
    below its simulated value), as soon as it is built. The refinement stops once a list
    schedule reaches ``target`` (a lower bound: nothing better exists). Also returns the runners-up (up to
    ``_STARTS - 1``: the best simulated candidate within the limit of each other origin, best
    first): further starts for the local search. ``built`` receives the classic schedules it
    built, by kind, with their timelines where it simulated them (None: over the limit)."""
    found: list[tuple[float, str, list[list[Action]], Policy]] = []
    began = time.monotonic()
    for policy in candidate_policies(problem):
        until = (deadline if grid is None else grid) if found else hard
        if time.monotonic() > until:
            break
        out = list_schedule(problem, policy, until)
        if out is not None:
            if report is not None and all(out[1] < v for v, _, _, _ in found):
                report(out[1])
            found.append((out[1], policy.name, out[0], policy))
    found.sort(key=lambda x: x[0])
    # The best few policies of distinct structure (depth, lag, fit), their wait knobs refined
    # over every value that changes the schedule: the grid samples them at a few points only.
    # Their schedules are candidates next to the grid's best, not instead of them: the grid's
    # are often better starts for the local search (their waits are less tightly phased).
    until = (deadline if grid is None else grid) if found else hard
    until = min(until, time.monotonic() + _REFINE_TIME * (time.monotonic() - began))
    refined: list[tuple[float, str, list[list[Action]]]] = []
    structures: set[tuple] = set()
    for value, _, _, policy in found:
        shape = (policy.depth, policy.lag, policy.fit, policy.fuse)
        so_far = min([found[0][0]] + [v for v, _, _ in refined])
        if len(structures) == _REFINED or time.monotonic() > until or shape in structures or so_far <= target:
            continue
        structures.add(shape)
        better = refine_waits(problem, policy, value, until, target)
        if better is not None:
            if report is not None and better[2] < so_far:
                report(better[2])
            refined.append((better[2], better[0].name, better[1]))
    refined.sort(key=lambda x: x[0])
    # the given start first: within a smaller limit, it is what makes results monotone in memory
    given = start
    # (origin, name, builder): the origin tells the runners-up apart (see below)
    cands: list[tuple[str, str, Callable[[], list[list[Action]]]]] = []
    if given is not None:
        cands.append(("given", "given", lambda: given))
    cost, m = problem.cost, problem.num_microbatches
    cands += [("refined", name, functools.partial(_same, rows)) for _, name, rows in refined[:keep]]
    cands += [("grid", name, functools.partial(_same, rows)) for _, name, rows, _ in found[:keep]]
    for kind in _classic_kinds(problem):
        cands.append(("classic", kind, functools.partial(KINDS[kind].build_by, cost, m, deadline)))
    cands.append(("sequential", "sequential", lambda: sequential_schedule(problem)))
    timed: list[tuple[float, str, list[list[Action]], Timeline, str]] = []
    sim_s = 0.0
    for origin, name, build in cands:
        if timed and time.monotonic() > deadline:
            break
        rows = build()
        if origin == "classic" and built is not None:
            built[name] = (rows, None)
        if not problem.fits_order(rows):
            continue  # over the limit (e.g. ZB-H2 at 1p): no need to time it
        tick = time.monotonic()
        value, tl = problem.evaluate(rows)
        sim_s = max(sim_s, time.monotonic() - tick)
        if origin == "classic" and built is not None:
            built[name] = (rows, tl)
        if problem.fits(tl):
            timed.append((value, name, rows, tl, origin))
    assert timed  # the sequential schedule fits every limit check_limit accepts
    timed.sort(key=lambda x: x[0])  # stable: of equal values the earlier candidate
    best = timed[0]
    # runners-up: the best of each other origin (a refined list schedule, the grid's, a classic
    # one...), which tend to lie in other basins of the local search than the best
    others: list[list[list[Action]]] = []
    origins = {best[4]}
    for _, _, rows, _, origin in timed[1:]:
        if len(others) < _STARTS - 1 and origin not in origins and rows != best[2]:
            origins.add(origin)
            others.append(rows)
    return best[1], best[2], best[3], sim_s, others


def solve(
    profile: Profile,
    num_microbatches: int,
    mem_limit: str | list[float] | None = "2p",
    *,
    chunks: int = 1,
    time_limit: float = 30.0,
    objective: Objective = "span",
    uniform_costs: bool = False,
    milp: bool = True,
    start: list[list[Action]] | None = None,
    progress: Progress | None = None,
) -> SolveResult:
    """Best schedule found within ``time_limit`` seconds, validated, with its gap to a lower bound.

    ``start``: a schedule (per-rank action lists of F, B and W) to consider as well, e.g. the
    best one at a smaller memory limit."""
    t0 = time.monotonic()
    deadline = t0 + time_limit
    m = num_microbatches
    if objective not in ("span", "makespan"):
        raise ZbError(f"objective must be 'span' or 'makespan', not {objective!r}")
    stage_to_rank = solver_placement(profile.num_ranks, chunks)
    cost = CostModel.from_profile(profile, stage_to_rank)
    cost.check_microbatches(m)
    spec = None if isinstance(mem_limit, list) else mem_limit
    limit = list(mem_limit) if isinstance(mem_limit, list) else parse_memory_limit(mem_limit, profile, cost)
    if limit is not None and len(limit) != cost.num_ranks:
        raise ZbError(f"memory limit has {len(limit)} values for {cost.num_ranks} ranks")
    check_limit(cost, m, limit, spec, "bytes" if profile.memory_unit == "bytes" else "M_B")

    true = Problem(cost, m, tuple(limit) if limit is not None else None, objective)
    build_cost = CostModel.from_profile(uniform_profile(profile), stage_to_rank) if uniform_costs else cost
    search = Problem(build_cost, m, true.limit, objective)
    bound_fn = memory_span_lower_bound if objective == "span" else memory_makespan_lower_bound
    bound = bound_fn(cost, m, limit, quick=True)  # the full bound once a schedule is in hand

    def report(phase: str, value: float) -> None:
        if progress is not None:
            progress(phase, value, bound)

    report("constructing", float("inf"))
    # What no deadline cuts comes after construction: one simulation (of the fallback, if a list
    # schedule is cut), building and validating the result. Each is a pass over the schedule, like
    # the feasibility check and quick bound above, so as long as those took is kept back for it.
    # With the MILP to follow, construction gets a third of the limit; without, all of it, two
    # thirds for the policy grid and the rest for timing the best of them and the classic orders.
    hard = deadline - (time.monotonic() - t0)

    def target() -> float:
        """Where a search may stop: at the bound as it stands (nothing better exists); with
        uniform costs never (the search's values are on other costs than the bound's)."""
        return float("-inf") if uniform_costs else bound * (1 + _CLOSED)

    def building(v: float) -> None:
        if not uniform_costs:  # else the value is on other costs than the bound's
            report("constructing", v)

    built: dict[str, tuple[list[list[Action]], Timeline | None]] = {}
    if milp:
        construction, rows, tl, sim_s, others = _construct(search, min(hard, t0 + time_limit / 3), hard, start,
                                                           report=building, target=target(), built=built)
    else:
        construction, rows, tl, sim_s, others = _construct(search, hard, hard, start, report=building, target=target(),
                                                           grid=min(hard, t0 + time_limit * 2 / 3), built=built)
    value, tl = (true.value(tl), tl) if not uniform_costs else true.evaluate(rows)
    # The classic schedules within the limit, on the true costs: candidates, and what to beat
    # (those the construction built are reused). Each new one costs a build and a simulation:
    # one is started only while as long as three simulations is left before the end's reserve.
    # 1F1B is left out where splitting loses nothing: 1F1B with split backwards is never longer.
    baselines, not_built = classic_baselines(
        profile, m, spec if spec is not None else limit, chunks, objective, deadline=min(hard, t0 + time_limit / 3),
        until=deadline - 5 * sim_s, built=None if uniform_costs else built,
        skip=() if cost.fusing_may_pay() else ("1f1b",))
    for b in baselines:
        if b.stage_to_rank == stage_to_rank and b.value < value:
            construction, rows, tl, value = b.kind, b.rows, b.timeline, b.value
    if cost.fusing_may_pay():  # each backward that its W follows at once fused, or every one
        for variant in (_fuse_adjacent(cost, rows), _fuse_all(cost, rows)):
            if variant != rows and true.fits_order(variant):
                v2, tl2 = true.evaluate(variant)
                if v2 < value:
                    construction, rows, tl, value = construction + ", fused", variant, tl2, v2
    # Keep back time for the end: re-timing a schedule the MILP changed, then building and
    # validating the file (together about as long as a simulation; prediction reuses it).
    deadline -= 2 * sim_s
    report("constructed", value)
    now = time.monotonic()
    if now < deadline:  # its slow part gets half the time left, and is left out if it needs more
        bound = max(bound, bound_fn(cost, m, limit, deadline=now + (deadline - now) / 2))
        report("lower bound", value)
    method = "heuristic"
    windows = improvements = searched = 0
    hit_limit = False
    # the best classic schedule on another placement: once the bound reaches it, nothing on
    # the solver's placement can beat it and the search may stop
    elsewhere = min((b.value for b in baselines if b.stage_to_rank != stage_to_rank), default=float("inf"))

    def closed() -> bool:
        return min(value, elsewhere) <= bound * (1 + _CLOSED)

    if milp and not closed() and time.monotonic() < deadline:
        from .milp import exact, improve  # PuLP and HiGHS load only when needed

        method = "heuristic+milp"

        def search_orders(share: float, others: Sequence[list[list[Action]]] = ()) -> None:
            """Local search over all orders, non-FIFO ones included (which neither MILP ranges
            over), and over fusing or splitting each backward where that may pay, for ``share``
            of the time left from the best schedule, then as much from each of ``others``
            (further starts) in turn until one reaches the bound; not with uniform costs (not
            the true objective)."""
            nonlocal rows, value, searched
            before = value
            for begin in [rows, *others]:
                if share <= 0 or closed() or uniform_costs or time.monotonic() >= deadline:
                    break
                stop = time.monotonic() + share * (deadline - time.monotonic())
                found = local_search(true, begin, stop, target=target())
                v, tl2 = true.evaluate(found)
                if v < value and true.fits(tl2):
                    rows, value = found, v
                report("local search", value)
            searched += value < before

        passes = 3 * cost.num_stages * m
        small = passes <= _EXACT_PASSES
        # further starts only where no exact model follows: on small problems it needs the time
        # (at -t 2 under load, V p=3 m=3 1p lost its optimum to three searches before it)
        search_orders(_SEARCH_SHARE[0] if small else _SEARCH_SHARE_LARGE if passes <= _SEARCH_PASSES else 0.0,
                      [] if small else others)
        if small and not uniform_costs:
            # the idle relaxation for the bound, then (span) the best FIFO order under ASAP;
            # both choose to fuse or split each backward where that may pay
            for relaxed in (True, False) if objective == "span" else (True,):
                if closed() or time.monotonic() >= deadline:
                    break
                res = exact(true, rows, (deadline - time.monotonic()) / (2 if relaxed and objective == "span" else 1), relaxed)
                if res is not None:
                    v2, tl2 = true.evaluate(res.rows)
                    if v2 < value and true.fits(tl2):
                        rows, value = res.rows, v2
                        improvements += 1
                    if relaxed:
                        bound = max(bound, res.dual_bound)
                    hit_limit = not res.optimal
                    windows += 1
                report("exact MILP", value)
            search_orders(_SEARCH_SHARE[1])
        if not closed() and time.monotonic() < deadline:
            # windows: the exact model is the idle relaxation, whose solution ASAP may run worse
            rows, stats = improve(search, rows, deadline, lambda v, st: report("MILP windows", v), target())
            windows, improvements = windows + stats.windows, improvements + stats.improved
            hit_limit = not stats.converged
    if method != "heuristic":
        value, tl = true.evaluate(rows)
    hit_limit = hit_limit or time.monotonic() >= deadline  # a search was cut short
    # A classic schedule on another placement (interleaved 1F1B) is a candidate as it stands:
    # the bound covers every schedule on the solver's placement and these.
    place, chosen_limit = stage_to_rank, limit
    for b in baselines:
        if b.stage_to_rank != stage_to_rank:
            bound = min(bound, b.value)
            if b.value < value:
                construction, rows, tl, value, place, chosen_limit = b.kind, b.rows, b.timeline, b.value, b.stage_to_rank, b.limit
    gap = max(0.0, value / bound - 1) if bound > 0 else 0.0
    status = decide_status(gap, hit_limit)
    fused = sum(a.op is Op.BW for row in rows for a in row)
    info = SolverInfo(
        method=method, construction=construction, objective=objective, status=status, value=value,
        lower_bound=bound, gap=gap, time_s=round(time.monotonic() - t0, 3), time_limit_s=time_limit,
        memory_limit=spec if spec is not None else (None if limit is None else "per rank"),
        uniform_costs=uniform_costs, milp_windows=windows, milp_improvements=improvements,
        search_improvements=searched, classic={b.kind: b.value for b in baselines}, classic_not_built=not_built,
        fused_backwards=fused, split_backwards=sum(a.op is Op.B for row in rows for a in row),
    )
    sched = Schedule.build(_kind(rows, baselines, place, fused, chunks, spec), profile, m, place, rows,
                           memory_limit=chosen_limit, memory_limit_spec=spec, solver=info)
    validate(sched, timeline=tl)  # tl: the final rows on the true costs, simulated once
    report("done", value)
    return SolveResult(with_prediction(sched, tl), info, tl)


def _kind(rows: list[list[Action]], baselines: list[Baseline], place: list[int], fused: int, chunks: int,
          spec: str | None) -> str:
    """The schedule's name: the classic kind whose order it is, else zb-... where some backward
    is split (zb-v-... on the V placement), fused-... where every one is fused, and the limit."""
    for b in baselines:
        if b.stage_to_rank == place and b.rows == rows:
            return b.kind
    split = any(a.op is Op.B for row in rows for a in row)
    return ("zb" if split or not fused else "fused") + ("-v" if chunks == 2 else "") + "-" + (
        spec.strip().lower() if spec else "solver")


def _fuse_adjacent(cost: CostModel, rows: list[list[Action]]) -> list[list[Action]]:
    """``rows`` with each B that its own W follows at once run as one BW, on the stages where a
    fused backward may pay (``CostModel.fusing_may_pay``)."""
    pays = [cost.t_bw[s] < cost.t_b[s] + cost.t_w[s] or cost.t_ff[s] < cost.t_f[s] for s in range(cost.num_stages)]
    out = []
    for row in rows:
        new: list[Action] = []
        i = 0
        while i < len(row):
            a = row[i]
            if a.op is Op.B and pays[a.stage] and i + 1 < len(row) and row[i + 1] == Action(a.stage, Op.W, a.mb):
                new.append(Action(a.stage, Op.BW, a.mb))
                i += 2
            else:
                new.append(a)
                i += 1
        out.append(new)
    return out


def _fuse_all(cost: CostModel, rows: list[list[Action]]) -> list[list[Action]]:
    """``rows`` with every backward fused where that costs less (t_ff + t_bw < t_f + t_b + t_w):
    each B becomes a BW and its W goes. Memory is freed no later than before where W frees it."""
    pays = [cost.t_ff[s] + cost.t_bw[s] < cost.t_f[s] + cost.t_b[s] + cost.t_w[s] for s in range(cost.num_stages)]
    return [[Action(a.stage, Op.BW, a.mb) if a.op is Op.B and pays[a.stage] else a
             for a in row if not (a.op is Op.W and pays[a.stage])] for row in rows]
