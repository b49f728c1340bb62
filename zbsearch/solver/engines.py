"""Search engines: what improves a solve's schedule, and maybe its bound, once it is constructed.

An engine gets the solve's state (``SolveRun``: the problem, the best schedule so far, the
bound) and an instant to stop by, and offers the schedules it finds through ``SolveRun.offer``,
which keeps one only if the core simulator says it is valid, within the limit, recomputes as
asked and is better. So an engine cannot make a result worse or wrong, only better; a bound it
proves goes through ``SolveRun.raise_bound``. This is the seam where another engine (a CP
solver, say) plugs in: pass ``solve(engines=[...])``.

The default engines, in order (``default_engines``): the local search over per-rank orders
(``local_search``; where it chooses what to recompute, a larger share: the windows below keep
recomputation as it is), the exact MILP on small problems (``milp.exact``, which can prove
optimality; where the solve may recompute, it searches FIFO orders and every choice of
recomputation, and runs first), the local search again, then MILP windows (``milp.improve``)
until the deadline. The ``Budget``'s shares say how long each may take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .. import clock
from ..actions import Action
from .local_search import local_search_paired

if TYPE_CHECKING:
    from .solve import SolveRun

__all__ = ["Engine", "LocalSearch", "ExactMILP", "MILPWindows", "default_engines", "EXACT_PASSES"]

# Problems up to this many passes get the exact MILP: it can prove optimality.
EXACT_PASSES = 120


class Engine(Protocol):
    """Improves a solve's schedule (and maybe its bound) until ``until`` (``deadline.now()``)."""

    name: str

    def improve(self, run: SolveRun, until: float) -> None:
        """Search for a schedule better than ``run``'s until ``until`` (monotonic seconds), offering it to ``run``."""
        ...


@dataclass
class LocalSearch:
    """The local search over every per-rank order (non-FIFO too), fused or split backwards,
    overlapped pairs where the passes hold all-to-all and, where allowed, recomputation: for
    ``share`` of the time left from the best schedule (with its pairs), then as long from each
    of the solve's further starts in turn (``with_starts``), until one reaches the bound; not
    with uniform costs (not the true objective)."""

    share: float
    with_starts: bool = False
    name: str = "local search"

    def improve(self, run: SolveRun, until: float) -> None:
        """Local search from the best schedule (and, if asked, the other constructions), each start a share of the time left."""
        before = run.value
        starts: Sequence[list[list[Action]]] = run.others if self.with_starts else ()
        for begin in [run.rows, *starts]:
            if self.share <= 0 or run.closed() or run.uniform_costs:
                break
            if clock.now() >= until:
                run.hit_limit = True  # a start left unsearched
                break
            stop = clock.now() + self.share * (until - clock.now())
            found, pairs = local_search_paired(run.problem, begin, run.overlapped if begin is run.rows else None, stop,
                                               target=run.target())
            # it ends at its time, at the target (then the gap closes) or where no move is allowed at all
            cut = clock.now() >= stop
            run.offer(found, pairs=pairs)
            run.hit_limit |= cut and not run.closed()
            run.report(self.name)
        run.searched += run.value < before


@dataclass
class ExactMILP:
    """The exact MILP of the whole schedule: the idle relaxation (its dual bound is a lower bound
    for every schedule, fused, split or mixed, with or without overlapped pairs, which it
    chooses where the passes hold all-to-all, fusing a choice too) and, for the span, the best
    FIFO order under ASAP execution. Where the solve may recompute, the model chooses that too,
    and is a search over FIFO orders only (``milp.exact``): for the span only the ASAP model
    runs, and no bound comes of it."""

    relaxed_share: float = 0.5
    name: str = "exact MILP"

    def improve(self, run: SolveRun, until: float) -> None:
        """The exact MILP over whole per-rank orders, where its size allows; its optimum and dual bound go to ``run``."""
        from .milp import exact  # PuLP and HiGHS load only when needed

        if run.uniform_costs:
            return
        span = run.problem.spans
        for relaxed in ((False,) if run.problem.cost.can_recompute else (True, False)) if span else (True,):
            if run.closed():
                break
            if clock.now() >= until:
                run.hit_limit = True  # a model left unsolved
                break
            left = until - clock.now()
            res = exact(run.problem, run.rows, left * (self.relaxed_share if relaxed and span else 1.0), relaxed,
                        pairs=run.overlapped)
            run.hit_limit |= res is None or not res.optimal  # HiGHS stopped at its time (it starts from a solution)
            if res is not None:
                if run.offer(res.rows, pairs=res.pairs):
                    run.improvements += 1
                if relaxed:  # (-inf where the model is no bound)
                    run.raise_bound(res.dual_bound)
                run.windows += 1
            run.report(self.name)


@dataclass
class MILPWindows:
    """MILP windows over the schedule (``milp.improve_paired``: with overlapped pairs where the
    passes hold all-to-all) until the gap closes or ``until``; the windows' model is the idle
    relaxation, whose solutions the simulator then times."""

    name: str = "MILP windows"

    def improve(self, run: SolveRun, until: float) -> None:
        """Re-order windows of the best schedule with the MILP until no window improves or time runs out."""
        from .milp import improve_paired

        if run.closed():
            return
        if clock.now() >= until:
            run.hit_limit = True
            return
        rows, pairs, stats = improve_paired(run.search, run.rows, run.overlapped, until,
                                            lambda v, st: run.report(self.name, v), run.target())
        run.windows += stats.windows
        run.improvements += stats.improved
        run.hit_limit |= not stats.converged
        run.adopt_unchecked(rows, pairs)


def default_engines(run: SolveRun) -> list[tuple[Engine, float | None]]:
    """The default engines for this solve, each with the share of the time left it stops by
    (None: the deadline); none without the MILP (``milp=False``)."""
    if not run.milp:
        return []
    sh = run.budget.shares
    passes = run.num_passes
    small = passes <= EXACT_PASSES
    out: list[tuple[Engine, float | None]] = []
    # further starts only where no exact model follows: on small problems it needs the time
    large = sh.search_recompute if run.problem.recompute == "auto" else sh.search_large
    first = sh.search_first if small else large if passes <= sh.search_passes else 0.0
    if small and run.problem.cost.can_recompute:  # the exact model's choice of recomputation first
        out.append((ExactMILP(), sh.exact_recompute))
    else:
        out.append((LocalSearch(first, with_starts=not small), None))
    if small:
        if not run.problem.cost.can_recompute:
            out.append((ExactMILP(sh.exact_relaxed), None))
        out.append((LocalSearch(sh.search_second), None))
    out.append((MILPWindows(), None))
    return out
