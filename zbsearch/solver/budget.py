"""The time a solve may take, and how its phases share it: the one owner of the time budget.

A solve runs in phases (``zbsearch.solver.solve``): construct, compare with the classic
schedules, prove a bound, improve with search engines, finish. Each phase asks the ``Budget``
until when it may run; none keeps its own clock arithmetic. The shares are the ``Shares`` below,
named and documented in one place.

What no deadline cuts (simulating the result, building and validating the schedule file) is
kept back: ``keep_back`` moves the deadline earlier by what such a step has been seen to take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import clock

__all__ = ["Shares", "Budget"]


@dataclass(frozen=True)
class Shares:
    """How a solve's phases share its time limit (fractions of the limit, or of the time left).

    Attributes:
        construct: with search engines to follow, the list-scheduling grid and the timing of
            its best candidates end by this share of the limit; the engines get the rest.
        grid: without engines (``milp=False``), the grid stops by this share of the limit and
            the rest goes to timing its best candidates and the classic orders.
        restricted: with ``recompute`` "auto", the share of the construction phase that the
            constructions without and with full recomputation take together, after the one
            with the solver's own choice of recomputation.
        refine: the wait knobs of the grid's best policies are refined for at most this many
            times as long as the grid took.
        late, late_s: how long past its deadline (this share of the limit, or these seconds
            where more) a construction still builds and times candidates; after that it keeps
            the first schedule it has (on thousands of passes one build and simulation takes a
            large part of a second; on a few hundred, milliseconds, and each candidate counts).
        classics: the classic baselines are built by this share of the limit; one is started
            only while ``classic_sims`` simulations' time is left before the end's reserve.
        classic_sims: see ``classics``.
        end_sims: simulations' time kept back for the end (re-timing, building, validating).
        bound: the slow (chain) bound gets this share of the time left, and is left out where
            it needs more; the area and relay bounds' integer programs (per rank) run within it
            too, their LP relaxations once it has passed.
        search_first, search_second: on problems small enough for the exact MILP, the local
            search's share of the time left before and after it.
        search_large: beyond the exact MILP's size, the local search's share (then the MILP
            windows); beyond ``search_passes`` passes, none: each candidate costs a
            simulation of thousands of passes and the windows improve many at once.
        search_recompute: as ``search_large`` where the solver chooses what to recompute
            ("auto"): the MILP windows keep each microbatch's recomputation as it is, the local
            search changes it, so it gets the larger share.
        exact_relaxed: for the span, the exact idle relaxation's share of the time left before
            the exact ASAP model.
        exact_recompute: where the solve may recompute, on problems small enough for the exact
            MILP: its share of the time left, before the local search (``search_second``). It
            chooses what to recompute together with the order, which the local search does one
            move at a time, and on such problems it is done in about a second.
        lane: for the iteration, ordering the W passes of multi-stage ranks for the reduction
            lane (``lane_order``): its share of the time left after the constructions.
        pairs: where the passes hold all-to-all, choosing overlapped pairs on the best order
            and on the classic orders that come with pairs (``pairing``): its share of the
            time left after the bound, kept back from the engines.
    """

    construct: float = 1 / 3
    grid: float = 2 / 3
    restricted: float = 1 / 3
    refine: float = 3.0
    late: float = 0.25
    late_s: float = 1.0
    classics: float = 1 / 3
    classic_sims: int = 5
    end_sims: int = 2
    bound: float = 0.5
    search_first: float = 0.25
    search_second: float = 0.5
    search_large: float = 0.1
    search_recompute: float = 0.5
    search_passes: int = 2000
    exact_relaxed: float = 0.5
    exact_recompute: float = 0.5
    lane: float = 0.25
    pairs: float = 0.3


@dataclass
class Budget:
    """A solve's clock: its start, its limit, its deadline (the limit less what the end keeps
    back) and the phases' ``shares``."""

    limit: float
    shares: Shares = field(default_factory=Shares)
    start: float = field(default_factory=lambda: clock.now())
    kept: float = 0.0  # seconds kept back for the end

    @property
    def deadline(self) -> float:
        """When the searches must stop (``self.now()``)."""
        return self.start + self.limit - self.kept

    def now(self) -> float:
        """The clock every phase reads (monotonic seconds; the classic builders' too)."""
        return clock.now()

    def elapsed(self) -> float:
        """Seconds since the solve started."""
        return self.now() - self.start

    def left(self) -> float:
        """Seconds until the deadline (0 once passed)."""
        return max(0.0, self.deadline - self.now())

    def expired(self) -> bool:
        """Whether the time limit has passed."""
        return self.now() >= self.deadline

    def at(self, fraction: float) -> float:
        """The instant ``fraction`` of the limit after the start, no later than the deadline."""
        return min(self.deadline, self.start + fraction * self.limit)

    def share(self, fraction: float) -> float:
        """The instant ``fraction`` of the time left from now, before the deadline."""
        now = self.now()
        return now + fraction * max(0.0, self.deadline - now)

    def keep_back(self, seconds: float) -> None:
        """Keep ``seconds`` more for the end: the deadline moves earlier."""
        self.kept += max(0.0, seconds)
