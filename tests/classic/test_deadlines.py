"""The classic builders that improve their schedule step by step keep to a deadline, on a fake clock.

The clock (``zbsearch.clock.now``) is a counter each read advances by one: a deadline
k reads into a build passes at its k-th check. Whatever k, the builder returns a valid schedule
within the memory its kind promises, and reads the clock at most twice once the deadline has
passed (it stops, rather than finishing its construction); a deadline already passed gives
V-Half and V-Min their building blocks unsqueezed, built here without the squeezing code.
"""

from __future__ import annotations

import inspect

import pytest

from zbsearch import Profile, StageCost, build_classic, clock, find_problem
from zbsearch.classic import KINDS
from zbsearch.classic import controllable as ctl
from zbsearch.solver import solve


class Counter:
    def __init__(self) -> None:
        self.t = 0.0
        self.reads: list[float] = []

    def __call__(self) -> float:
        self.t += 1.0
        self.reads.append(self.t)
        return self.t


@pytest.fixture
def counter(monkeypatch):
    c = Counter()
    monkeypatch.setattr(clock, "now", c)
    return c


def _profile(p: int, uneven: bool) -> Profile:
    """Memory as the controllable-memory paper counts it (a chunk's F allocates 1, its W frees
    it, B frees nothing), so that V-Half and V-Min keep to their published peaks; times per rank
    uneven or all equal."""
    return Profile(name="deadline", memory_unit="activations", stages=[
        StageCost(t_f=2.0 + 0.6 * (r % 3) * uneven, t_b=2.4 if uneven else 2.0, t_w=2.0 - 0.2 * r * uneven / p,
                  m_f=2.0, m_b=0.0, m_w=-2.0) for r in range(p)])


# the most microbatches' activations a rank holds, in M_B (two chunks), by kind
_PEAK = {"v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3, "zb-v": lambda p: p}


def test_every_builder_that_takes_a_deadline_is_given_one():
    for name, kind in KINDS.items():
        assert kind.timed == ("deadline" in inspect.signature(kind.build).parameters), name


@pytest.mark.parametrize("kind", ["v-half", "v-min", "zb-v"])
@pytest.mark.parametrize("p, m", [(3, 6), (4, 12), (6, 13)])
def test_a_deadline_anywhere_in_the_build_gives_a_valid_schedule_and_stops_there(counter, kind, p, m):
    prof = _profile(p, uneven=True)
    build_classic(kind, prof, m)  # no deadline: the clock is not read
    assert not counter.reads
    build_classic(kind, prof, m, deadline=float("inf"))
    checks = len(counter.reads)
    assert checks >= 1
    for k in sorted({0, 1, 2, checks // 3, checks // 2, checks - 1, checks}):
        counter.t, counter.reads = 0.0, []
        sched = build_classic(kind, prof, m, deadline=float(k))
        assert find_problem(sched) is None, k
        assert max(sched.predicted.peak_memory) <= 2 * _PEAK[kind](p) + 1e-9, k
        assert sum(t > k for t in counter.reads) <= 2, k  # it stopped once it saw the deadline pass


@pytest.mark.parametrize("kind", ["v-half", "v-min"])
@pytest.mark.parametrize("p, m", [(4, 8), (5, 11)])
def test_a_passed_deadline_leaves_the_building_blocks_unsqueezed(counter, kind, p, m):
    prof = _profile(p, uneven=False)
    units = [[[start + 6 * j for j in range(m)] for start in dev] for dev in ctl.building_block(p, kind)]
    grid = ctl._Grid(p, m, units)
    grid.place_w(split=True)
    assert build_classic(kind, prof, m, deadline=0.0).rank_actions == grid.actions()
    assert build_classic(kind, prof, m).rank_actions != grid.actions()  # squeezing moves the warm-up and cool-down


def test_a_solve_hands_its_deadlines_to_the_builders(monkeypatch):
    """Past its deadline the solver builds only the classic order needing least memory, as built
    unsqueezed (its builder saw the deadline pass); with time, it squeezes every V kind."""
    prof = _profile(4, uneven=True)
    reads = iter(range(10**9))
    monkeypatch.setattr(clock, "now", lambda: 0.0 if next(reads) == 0 else 1e9)  # the solve starts, then time is up
    res = solve(prof, 8, None, chunks=2, time_limit=2.0, milp=False)
    assert find_problem(res.schedule) is None
    assert list(res.info.classic) == ["v-min"]
    assert res.info.classic["v-min"] == pytest.approx(max(build_classic("v-min", prof, 8, deadline=0.0).predicted.span))
    monkeypatch.undo()
    res = solve(prof, 8, None, chunks=2, time_limit=2.0, milp=False)
    for kind in ("v-half", "v-min"):
        assert res.info.classic[kind] == pytest.approx(max(build_classic(kind, prof, 8).predicted.span))
