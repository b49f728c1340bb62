"""The plan's one time limit: every phase and every solve ends within it, on a simulated clock.

The planner reads time from ``Clock.now`` only; here that clock is a counter that each solve
advances by the seconds it was given plus an overrun (as a solver's setup and hand-over take),
and each cut priced by a fixed cost. The real solver runs, briefly; no wall time is measured.
"""

from __future__ import annotations

import importlib

import pytest

from tests.helpers.layers import random_layers
from zbsearch.planner.plan import Clock, plan
from zbsearch.planner.search import Cuts
from zbsearch.solver import solve as real_solve

plan_module = importlib.import_module("zbsearch.planner.plan")

pytestmark = pytest.mark.slow  # the solver runs, briefly, for every solve the plan asks for


class FakeTime:
    def __init__(self, overrun: float, price: float) -> None:
        self.t = 1000.0
        self.overrun, self.price = overrun, price
        self.calls: list[tuple[float, float]] = []  # (when, seconds given)


@pytest.fixture
def fake(monkeypatch):
    def install(overrun: float, price: float = 0.0) -> FakeTime:
        ft = FakeTime(overrun, price)
        monkeypatch.setattr(Clock, "now", lambda self: ft.t)

        def solve(*args, time_limit, **kw):
            ft.calls.append((ft.t, time_limit))
            kw["milp"] = False
            res = real_solve(*args, time_limit=0.05, **kw)
            ft.t += time_limit + ft.overrun
            return res

        monkeypatch.setattr(plan_module, "solve", solve)
        evaluate = Cuts.evaluate

        def priced(self, counts):
            if counts not in self.seen:
                ft.t += ft.price
            return evaluate(self, counts)

        monkeypatch.setattr(Cuts, "evaluate", priced)
        return ft

    return install  # the solver's own clock stays the real one: only the planner's is faked


@pytest.mark.parametrize("limit, overrun, recompute", [(20.0, 0.3, "none"), (60.0, 1.0, "auto"), (5.0, 0.05, "auto")])
def test_every_solve_ends_within_the_one_limit(fake, limit, overrun, recompute):
    ft = fake(overrun)
    L = random_layers(5, 8, head=4.0, recompute="both")
    t0 = ft.t
    res = plan(L, 3, 4, None, placement="auto", time_limit=limit, recompute=recompute)
    assert ft.calls, "nothing solved"
    end = t0 + limit
    # after the first solve (whose overrun the planner cannot know), each solve is given at most
    # what is left before the margin less the overrun seen: so each ends in time
    for when, given in ft.calls[1:]:
        assert when + given + overrun <= end - max(0.02 * limit, 0.2) + 1e-9 or given <= plan_module._MIN_SOLVE_S
    assert ft.t <= end
    assert res.partition.time_s <= limit
    assert len(ft.calls) > 3  # the phases had time to run: baselines, quick solves, polish


def test_pricing_stops_at_its_share_and_the_bound_relaxes(fake):
    ft = fake(0.1, price=0.05)
    L = random_layers(6, 10)
    limit = 10.0
    t0 = ft.t
    res = plan(L, 4, 4, None, placement="one", time_limit=limit)
    # 84 cuts at 0.05 s each would take 4.2 s; pricing has 15% of the limit
    assert not res.partition.exhaustive
    assert res.partition.cuts_bounded < 84
    assert ft.calls[0][0] <= t0 + 0.15 * limit + 3 * 0.05 * 4  # the local search's last step may finish
    assert ft.t <= t0 + limit


def test_a_limit_too_short_for_any_phase_still_solves_one_cut(fake):
    ft = fake(0.5)
    L = random_layers(7, 6)
    res = plan(L, 2, 4, None, placement="one", time_limit=0.5)
    assert len(ft.calls) >= 1 and res.partition.value > 0
