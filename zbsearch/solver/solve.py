"""``solve``: the least-bubble schedule under a memory limit, with an honest gap.

Each microbatch's backward on each stage may run fused (one BW) or split (B, then W later);
where a fused one costs less (``CostModel.fusing_may_pay``) every phase ranges over both. With
``recompute`` "auto", each microbatch's forward on each stage may also run checkpointed and be
recomputed before its backward, where the profile offers it: every phase ranges over that too.

A solve is a ``SolveRun`` going through named phases, all timed by one ``Budget``
(``budget``: the shares of the time limit each phase may take):

1. ``construct``: every ``candidate_policies`` list schedule (split, and where fusing pays
   fused but for a cool-down tail; with recomputation, each rank's plan of which microbatches
   to checkpoint), the best few with their wait knobs refined (``refine_waits``), plus the
   handcrafted orders (ZB-H1/H2, ZB-V, the V building blocks V-Half and V-Min below 1F1B's
   memory, recomputing ones where allowed, and with ``recompute`` "auto" ZB-H1/H2 and 1F1B
   checkpointed into the limit, ``checkpointing``) and the sequential one, on the true per-stage costs
   (or, with ``uniform_costs``, on their median across stages as the paper's scheduler does,
   to show what per-stage costs buy). With ``recompute`` "auto", the constructions without
   recomputation and with full recomputation come first as candidates: "auto" offers every
   choice they have, so it never constructs worse than they would.
2. ``compare_classics``: every classic schedule within the limit (``baselines``) is a candidate
   and a figure to beat; ``try_fusing``: where fusing may pay, the best with its adjacent B, W
   fused and with every backward fused.
3. ``prove``: the lower bound is the largest of the one-machine bounds over any rank's passes
   (per pass type, and per pass with microbatch order and memory precedences), the
   memory-aware idle bound, the area bound, the relay bound (what another rank's memory makes a
   rank wait for) and the deferral bound (``zbsearch.bounds``, on costs no fused, split or
   recomputing schedule beats); the chain bound and the area and relay bounds' integer programs
   get ``Shares.bound`` of the time left (their LP relaxations past it); on small problems
   without recomputation the exact MILP may also raise it or close it. A classic schedule on
   another placement (interleaved 1F1B) caps it: the bound covers it too.
4. ``improve``: the search engines in turn (``engines``; the seam where another one plugs in):
   a local search over per-rank orders, fused or split backwards and recomputation (non-FIFO
   orders too, judged by simulation), the exact MILP on small problems, the local search
   again, then MILP windows until the gap closes or the time limit. Where the passes hold
   all-to-all, the schedules built around overlapped pairs join the candidates first
   (``offer_paired``), every engine chooses pairs too, and ``overlap`` searches pairs and
   order once more at the end.
5. ``finish``: the final schedule is validated by the core validator, memory limit included,
   before anything is returned; ``verdict`` says what it means.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import clock
from ..actions import RECOMPUTES, Action, Op
from ..bounds import memory_iteration_lower_bound, memory_makespan_lower_bound, memory_span_lower_bound
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
from .budget import Budget
from .construct import construct
from .engines import Engine, default_engines
from .feasibility import check_limit
from .heuristic import sequential_schedule
from .lane_order import order_for_lane
from .paired_v import paired_v_candidates
from .pairing import pair_passes
from .problem import RECOMPUTATIONS, Objective, Problem, Recomputation
from .verdict import CLOSED as _CLOSED
from .verdict import decide_status

__all__ = ["SolverInfo", "SolveResult", "SolveRun", "Progress", "progress_text", "solve", "uniform_profile",
           "solver_placement"]


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


@dataclass
class SolveRun:
    """One solve in progress: what its phases and engines read and improve.

    ``problem`` is judged on the true costs, ``search`` on the costs the heuristics build with
    (the same, or the median stage's with ``uniform_costs``); ``rows``/``value``/``timeline``
    the best schedule so far, ``bound`` the best lower bound. Engines offer schedules through
    ``offer`` and bounds through ``raise_bound`` (``zbsearch.solver.engines``)."""

    profile: Profile
    problem: Problem
    search: Problem
    budget: Budget
    spec: str | None
    limit: list[float] | None
    chunks: int
    milp: bool
    uniform_costs: bool
    progress: Progress | None = None
    rows: list[list[Action]] = field(default_factory=list)
    value: float = float("inf")
    timeline: Timeline | None = None
    construction: str = ""
    bound: float = 0.0
    others: list[list[list[Action]]] = field(default_factory=list)
    baselines: list[Baseline] = field(default_factory=list)
    not_built: list[str] = field(default_factory=list)
    method: str = "heuristic"
    windows: int = 0
    improvements: int = 0
    searched: int = 0
    hit_limit: bool = False
    stale: bool = False  # rows adopted without timing on the true costs (MILP windows)
    sim_s: float = 0.0  # the longest simulation seen
    built: dict[str, tuple[list[list[Action]], Timeline | None]] = field(default_factory=dict)  # classic, by kind
    overlapped: list[list[int]] | None = None  # the best schedule's overlapped pairs (``overlap``, at the end)
    paired: list[tuple[str, list[list[Action]], list[list[int]]]] | None = None  # ``paired_starts``, once built

    # ---- what engines use ----------------------------------------------------------------

    @property
    def num_passes(self) -> int:
        """Passes in one step (F, B and W per stage and microbatch): the size the phases scale with."""
        c = self.problem.cost
        return 3 * c.num_stages * self.problem.num_microbatches

    def report(self, phase: str, value: float | None = None) -> None:
        """Tell the progress callback the phase, the value (the best so far unless given) and the bound."""
        if self.progress is not None:
            self.progress(phase, self.value if value is None else value, self.bound)

    def target(self) -> float:
        """Where a search may stop: at the bound as it stands (nothing better exists); with
        uniform costs never (the search's values are on other costs than the bound's)."""
        return float("-inf") if self.uniform_costs else self.bound * (1 + _CLOSED)

    def elsewhere(self) -> float:
        """The best classic schedule on another placement: once the bound reaches it, nothing
        on the solver's placement can beat it."""
        place = list(self.problem.cost.stage_to_rank)
        return min((b.value for b in self.baselines if b.stage_to_rank != place), default=float("inf"))

    def closed(self) -> bool:
        """Whether the best schedule is within the closing tolerance of the bound: nothing left to search for."""
        return min(self.value, self.elsewhere()) <= self.bound * (1 + _CLOSED)

    def offer(self, rows: list[list[Action]], name: str | None = None, pairs: list[list[int]] | None = None) -> bool:
        """Keep ``rows`` (with overlapped ``pairs``, None: none) if the simulator times it shorter
        on the true costs, within the limit and recomputing as asked; whether it was kept."""
        if rows is self.rows or not self.problem.complete_recomputation(rows):
            return False
        pairs = pairs if pairs and any(pairs) else None
        value, tl = self.problem.evaluate(rows, pairs)
        if value < self.value and self.problem.fits(tl):
            self.rows, self.overlapped, self.value, self.timeline = rows, pairs, value, tl
            if name is not None:
                self.construction = name
            return True
        return False

    def adopt_unchecked(self, rows: list[list[Action]], pairs: list[list[int]] | None = None) -> None:
        """Take ``rows`` with overlapped ``pairs`` as they are (MILP windows, which keep only what
        the simulator confirms on the search's costs); timed on the true costs at the end."""
        if rows is not self.rows:
            self.rows, self.overlapped, self.stale = rows, pairs if pairs and any(pairs) else None, True

    def raise_bound(self, bound: float) -> None:
        """Keep the larger of the bound held and ``bound`` (every bound is sound, so the largest holds)."""
        self.bound = max(self.bound, bound)

    # ---- the phases ----------------------------------------------------------------------

    def construct(self, start: list[list[Action]] | None) -> None:
        """The best of the heuristics' schedules (``construct``), timed on the true costs.

        With ``recompute`` "auto", the constructions without recomputation and with full
        recomputation (each where it fits the limit) follow the one with the solver's choice of
        recomputation, sharing ``Shares.restricted`` of the phase: every schedule those would
        build is a candidate of this solve too, so "auto" never constructs worse than "none"
        or "full" would where their constructions complete."""
        sh, b = self.budget.shares, self.budget

        def building(v: float) -> None:
            if not self.uniform_costs:  # else the value is on other costs than the bound's
                self.report("constructing", v)

        built: dict[str, tuple[list[list[Action]], Timeline | None]] = {}
        hard = b.deadline
        end = b.at(sh.construct) if self.milp else b.at(sh.grid)
        late = max(sh.late * b.limit, sh.late_s)
        subs = [(self.search, self.problem)]
        if self.problem.recompute == "auto" and b.now() < end + late:  # (past it they would be skipped below)
            subs += [pair for mode in ("none", "full") if (pair := self._restricted(mode)) is not None]
        outs = []
        for k, (search, true) in enumerate(subs):
            now = b.now()
            if k == 0:  # the solver's own choice of recomputation, then the others share the rest
                own = 1.0 if len(subs) == 1 else 1.0 - sh.restricted
                until, last = now + (end - now) * own, hard
                deadline = until if self.milp else now + (hard - now) * own
            else:  # each a list schedule within its share, else the classic or sequential ones
                until = now + ((end if self.milp else hard) - now) / (len(subs) - k)
                if now + self.sim_s >= until + late:  # only further candidates: none ending long past the time
                    self.hit_limit = True
                    break
                last = deadline = until
            given = start if k == 0 else None  # (a start may recompute)
            # with engines to follow, the grid stops at the deadline (construct's default)
            name, rows, tl, sim_s, others, cut = construct(search, deadline, last, given, report=building,
                                                           target=self.target(), grid=None if self.milp else until,
                                                           built=built, refine=sh.refine, late=late,
                                                           step=self.sim_s)
            self.hit_limit |= cut
            # timed on the true costs with every recomputation the solve allows
            value, tl = (true.value(tl), tl) if search is self.problem else self.problem.evaluate(rows)
            outs.append((value, k, name, rows, tl, others))
            self.sim_s = max(self.sim_s, sim_s)
        outs.sort(key=lambda x: (x[0], x[1]))  # of equal values the solver's own choice (the first)
        self.value, _, self.construction, self.rows, self.timeline, self.others = outs[0]
        self.built.update(built)

    def _restricted(self, mode: Recomputation) -> tuple[Problem, Problem] | None:
        """The search and true problems recomputing as ``mode`` says ("none", "full"), None
        where that cannot meet the limit (or, for "full", the profile does not offer it on
        every stage)."""
        cost = self.problem.cost
        if mode == "full" and any(cost.offer(s, Op.R) is None for s in range(cost.num_stages)):
            return None
        true = Problem.make(cost, self.problem.num_microbatches, self.problem.limit, self.problem.objective, mode)
        if not true.fits_order(sequential_schedule(true)):
            return None
        search = true if self.search is self.problem else Problem.make(
            self.search.cost, self.search.num_microbatches, self.search.limit, self.search.objective, mode)
        return search, true

    def compare_classics(self) -> None:
        """The classic schedules within the limit, on the true costs: candidates, and what to
        beat (those the construction built are reused). Each new one costs a build and a
        simulation: one is started only while ``Shares.classic_sims`` simulations' time is left
        before the end's reserve (DualPipeV, where the passes hold all-to-all, whatever is
        left). 1F1B is left out where splitting loses nothing: 1F1B with split backwards is never
        longer."""
        sh, b = self.budget.shares, self.budget
        cost = self.problem.cost
        self.baselines, self.not_built = classic_baselines(
            self.profile, self.problem.num_microbatches, self.spec if self.spec is not None else self.limit, self.chunks,
            self.problem.objective, deadline=b.at(sh.classics), until=b.deadline - sh.classic_sims * self.sim_s,
            built=None if self.uniform_costs else self.built, skip=() if cost.fusing_may_pay() else ("1f1b",),
            recompute=self.problem.recompute, always=("dualpipe-v",) if cost.has_all_to_all else ())
        self.hit_limit |= bool(self.not_built)
        place = list(cost.stage_to_rank)
        for base in self.baselines:  # (one with pairs joins at the end: the phases between keep none)
            if base.stage_to_rank == place and base.value < self.value and base.pairs is None:
                self.construction, self.rows, self.timeline, self.value = base.kind, base.rows, base.timeline, base.value

    def try_fusing(self) -> None:
        """Where fusing may pay: the best with each backward that its W follows at once fused,
        and with every backward fused."""
        cost = self.problem.cost
        if not cost.fusing_may_pay():
            return
        for variant in (_fuse_adjacent(cost, self.rows), _fuse_all(cost, self.rows)):
            if variant != self.rows and self.problem.fits_order(variant):
                self.offer(variant, self.construction + ", fused")

    def order_lane(self) -> None:
        """For the iteration, on ranks with several stages: the best with its W passes ordered
        for the reduction lane (``lane_order``), within ``Shares.lane`` of the time left."""
        if not self.uniform_costs and not self.budget.expired():
            self.offer(order_for_lane(self.problem, self.rows, self.budget.share(self.budget.shares.lane)),
                       self.construction + ", lane order")

    def prove(self, bound_fn) -> None:
        """The full lower bound: its slow part gets ``Shares.bound`` of the time left, and is left
        out if it needs more."""
        b = self.budget
        if not b.expired():
            deadline = b.share(b.shares.bound)
            self.raise_bound(bound_fn(self.problem.cost, self.problem.num_microbatches, self.limit, deadline=deadline))
            self.hit_limit |= b.now() > deadline  # its slow part left out, or not finished within its share
            self.report("lower bound")

    def paired_starts(self) -> list[tuple[str, list[list[Action]], list[list[int]]]]:
        """The schedules built around pairs (``paired_v_candidates``), built once per solve (the
        search for their ramp depth stops at the deadline)."""
        if self.paired is None:
            self.paired = paired_v_candidates(self.problem, self.budget.expired)
        return self.paired

    def overlap(self, until: float) -> None:
        """Where the passes hold all-to-all: overlapped pairs chosen by ``pair_passes`` from the
        schedules built around pairs (``paired_v``), from the best schedule, and from each
        classic one of the placement that comes with its own pairs (dualpipe-v), sharing the
        time until ``until`` (past it, those with pairs of their own are only timed); the best
        of them is kept."""
        if not self.problem.cost.has_all_to_all:
            return
        if self.stale or self.timeline is None:
            self.value, self.timeline = self.problem.evaluate(self.rows, self.overlapped)
            self.stale = False
        place = list(self.problem.cost.stage_to_rank)
        starts: list[tuple[str, list[list[Action]], list[list[int]] | None]] = [*self.paired_starts()]
        starts.append((self.construction, self.rows, self.overlapped))
        starts += [(b.kind, b.rows, b.pairs) for b in self.baselines if b.stage_to_rank == place and b.pairs is not None]
        for k, (name, rows, pairs) in enumerate(starts):
            now = clock.now()
            if now >= until:  # past the time: each start with pairs of its own is still timed (one simulation)
                self.hit_limit = True
                if pairs is None:
                    continue
            share = max(0.0, until - now) / (len(starts) - k)
            got_rows, got_pairs, value, tl = pair_passes(self.problem, rows, pairs, now + share)
            if value < self.value:
                self.rows, self.overlapped, self.value, self.timeline = got_rows, got_pairs if any(got_pairs) else None, value, tl
                self.construction = name + (", overlapped" if any(got_pairs) else "")
        self.report("overlapped pairs")

    def offer_paired(self) -> None:
        """Where the passes hold all-to-all: the schedules built around pairs (``paired_v``) and
        each classic one of the placement with pairs of its own (dualpipe-v), as candidates the
        search engines start from (they choose pairs too)."""
        if not self.problem.cost.has_all_to_all:
            return
        place = list(self.problem.cost.stage_to_rank)
        starts = [*self.paired_starts()]
        starts += [(b.kind, b.rows, b.pairs) for b in self.baselines if b.stage_to_rank == place and b.pairs is not None]
        for name, rows, pairs in starts:
            self.offer(rows, name, pairs)
        self.report("overlapped pairs")

    def improve(self, engines: Sequence[tuple[Engine, float | None]]) -> None:
        """Each engine in turn until it is done, its share of the time left or the deadline."""
        if not engines or self.closed() or self.budget.expired():
            return
        self.method = "heuristic+milp"
        for engine, share in engines:
            if self.closed() or self.budget.expired():
                break
            engine.improve(self, self.budget.deadline if share is None else self.budget.share(share))

    def finish(self) -> SolveResult:
        """The result: timed on the true costs, the classic schedules on other placements as
        candidates (the bound covers them), validated, with its prediction and verdict."""
        if self.stale or self.timeline is None:
            self.value, self.timeline = self.problem.evaluate(self.rows, self.overlapped)
        self.hit_limit = self.hit_limit or self.budget.expired()  # a phase skipped or cut short
        place, chosen_limit = list(self.problem.cost.stage_to_rank), self.limit
        rows, tl, value, pairs = self.rows, self.timeline, self.value, self.overlapped
        for base in self.baselines:
            if base.stage_to_rank != place:
                self.bound = min(self.bound, base.value)
                if base.value < value:
                    self.construction, rows, tl, value, place, chosen_limit = (base.kind, base.rows, base.timeline,
                                                                               base.value, base.stage_to_rank, base.limit)
                    pairs = base.pairs
        gap = max(0.0, value / self.bound - 1) if self.bound > 0 else 0.0
        status = decide_status(gap, self.hit_limit)
        fused = sum(a.op is Op.BW for row in rows for a in row)
        recomputed = sum(a.op in RECOMPUTES for row in rows for a in row)
        info = SolverInfo(
            method=self.method, construction=self.construction, objective=self.problem.objective, status=status,
            value=value, lower_bound=self.bound, gap=gap, time_s=round(self.budget.elapsed(), 3),
            time_limit_s=self.budget.limit, clock=clock.kind(),
            memory_limit=self.spec if self.spec is not None else (None if self.limit is None else "per rank"),
            uniform_costs=self.uniform_costs, milp_windows=self.windows, milp_improvements=self.improvements,
            search_improvements=self.searched, classic={b.kind: b.value for b in self.baselines},
            classic_not_built=self.not_built, fused_backwards=fused,
            split_backwards=sum(a.op is Op.B for row in rows for a in row),
            recompute=self.problem.recompute, recomputed=recomputed,
            overlapped_pairs=sum(map(len, pairs)) if pairs else 0,
        )
        m = self.problem.num_microbatches
        sched = Schedule.build(_kind(rows, self.baselines, place, fused, recomputed, self.chunks, self.spec), self.profile,
                               m, place, rows, memory_limit=chosen_limit, memory_limit_spec=self.spec, solver=info,
                               overlapped=pairs)
        validate(sched, timeline=tl)  # tl: the final rows on the true costs, simulated once
        assert self.problem.complete_recomputation(rows) or place != list(self.problem.cost.stage_to_rank)
        self.report("done", value)
        return SolveResult(with_prediction(sched, tl), info, tl)


@clock.with_work_clock
def solve(
    profile: Profile,
    num_microbatches: int,
    mem_limit: str | list[float] | None = "2p",
    *,
    chunks: int = 1,
    time_limit: float = 30.0,
    objective: Objective | None = None,
    uniform_costs: bool = False,
    milp: bool = True,
    recompute: Recomputation = "none",
    start: list[list[Action]] | None = None,
    progress: Progress | None = None,
    engines: Sequence[Engine] | None = None,
    deterministic: bool = False,
) -> SolveResult:
    """Best schedule found within ``time_limit`` seconds, validated, with its gap to a lower bound.

    ``recompute``: "none" (no microbatch recomputed), "auto" (the solver decides per stage and
    microbatch, together with the order, under the limit) or "full" (every microbatch recomputed,
    as Megatron's full recomputation); "auto" and "full" need the profile's recomputation costs.
    ``start``: a schedule (per-rank action lists) to consider as well, e.g. the best one at a
    smaller memory limit. ``engines``: the searches that follow the construction, each until the
    deadline (default: ``engines.default_engines``; ``[]`` for heuristics only).
    ``deterministic``: ``time_limit`` counts work, not seconds (``zbsearch.clock``): the same
    inputs give the same schedule on any machine and load."""
    budget = Budget(time_limit)
    m = num_microbatches
    if objective is None:  # what the user's iteration costs, where the profile knows it
        objective = "iteration" if profile.has_reductions else "span"
    if objective not in ("span", "makespan", "iteration"):
        raise ZbError(f"objective must be 'span', 'makespan' or 'iteration', not {objective!r}")
    if objective == "iteration" and not profile.has_reductions:
        raise ZbError(f"objective 'iteration' needs the stages' reduction times: profile {profile.name!r} has none "
                      "(give --dp, --dp-bandwidth and --grad-bytes, or profile with data parallelism)")
    if recompute not in RECOMPUTATIONS:
        raise ZbError(f"recompute must be one of {', '.join(RECOMPUTATIONS)}, not {recompute!r}")
    stage_to_rank = solver_placement(profile.num_ranks, chunks)
    cost = CostModel.from_profile(profile, stage_to_rank)
    cost.check_microbatches(m)
    _check_recompute(profile, cost, recompute)
    spec = None if isinstance(mem_limit, list) else mem_limit
    limit = list(mem_limit) if isinstance(mem_limit, list) else parse_memory_limit(mem_limit, profile, cost)
    if limit is not None and len(limit) != cost.num_ranks:
        raise ZbError(f"memory limit has {len(limit)} values for {cost.num_ranks} ranks")
    check_limit(cost, m, limit, spec, "bytes" if profile.memory_unit == "bytes" else "M_B", recompute)

    true = Problem.make(cost, m, tuple(limit) if limit is not None else None, objective, recompute)
    build_cost = CostModel.from_profile(uniform_profile(profile), stage_to_rank) if uniform_costs else cost
    search = Problem.make(build_cost, m, true.limit, objective, recompute)
    run = SolveRun(profile, true, search, budget, spec, limit, chunks, milp, uniform_costs, progress)
    bound_fn = {"span": memory_span_lower_bound, "makespan": memory_makespan_lower_bound,
                "iteration": memory_iteration_lower_bound}[objective]
    run.bound = bound_fn(true.cost, m, limit, quick=True)  # the full bound once a schedule is in hand
    run.report("constructing")
    # What no deadline cuts (a simulation of the fallback, building and validating the result)
    # is as long as a pass over the schedule, like the checks and quick bound above: keep back
    # as long as those took.
    budget.keep_back(budget.elapsed())
    run.construct(start)
    run.compare_classics()
    run.try_fusing()
    run.order_lane()
    # keep back time for re-timing a schedule an engine changed, then building and validating
    # the file (together about as long as a simulation; the prediction reuses it)
    budget.keep_back(budget.shares.end_sims * run.sim_s)
    run.report("constructed")
    run.prove(bound_fn)
    pairs_until = budget.deadline
    if true.cost.has_all_to_all:  # the pairs are chosen last, on the best order: keep them a share
        budget.keep_back(budget.shares.pairs * budget.left())
    run.offer_paired()
    run.improve(default_engines(run) if engines is None else [(e, None) for e in engines])
    run.overlap(pairs_until)
    return run.finish()


def _check_recompute(profile: Profile, cost: CostModel, recompute: Recomputation) -> None:
    """One line where the profile cannot recompute as asked."""
    if recompute == "none":
        return
    if recompute == "full":
        missing = [s for s in range(cost.num_stages) if cost.offer(s, Op.R) is None]
        if missing:
            raise ZbError(f"--recompute full: profile {profile.name!r} has no full recomputation costs (t_r, m_fc) "
                          f"for stage {missing[0]}; measure them with zbsearch profile")
    elif not cost.can_recompute:
        raise ZbError(f"--recompute auto: profile {profile.name!r} has no recomputation costs (t_r and m_fc, or "
                      f"t_rs and m_fs, per stage); measure them with zbsearch profile")


def _kind(rows: list[list[Action]], baselines: list[Baseline], place: list[int], fused: int, recomputed: int,
          chunks: int, spec: str | None) -> str:
    """The schedule's name: the classic kind whose order it is, else zb-... where some backward
    is split (zb-v-... on the V placement), fused-... where every one is fused, -r- where it
    recomputes, and the limit."""
    for b in baselines:
        if b.stage_to_rank == place and b.rows == rows:
            return b.kind
    split = any(a.op is Op.B for row in rows for a in row)
    return ("zb" if split or not fused else "fused") + ("-v" if chunks == 2 else "") + ("-r" if recomputed else "") + "-" + (
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
