"""The plan's one time limit: every phase and every solve ends within it, on a simulated clock.

The planner reads time from ``Clock.now`` only; here that clock is a counter that each solve
advances by the seconds it was given plus an overrun (as a solver's setup and hand-over take),
and each cut priced by a fixed cost. The real solver runs, briefly; no wall time is measured.
"""

from __future__ import annotations

import importlib

import pytest

from tests.helpers.layers import random_layers
from zbsearch.planner import Cut, llama_layers
from zbsearch.planner.compose import static_bytes
from zbsearch.planner.plan import Clock, plan
from zbsearch.planner.search import Cuts, compositions
from zbsearch.solver import solve as real_solve
from zbsearch.solver.verdict import CLOSED

plan_module = importlib.import_module("zbsearch.planner.plan")

pytestmark = pytest.mark.slow  # the solver runs, briefly, for every solve the plan asks for


class FakeTime:
    def __init__(self, overrun: float, price: float) -> None:
        self.t = 1000.0
        self.overrun, self.price = overrun, price
        self.calls: list[tuple[float, float, float]] = []  # (when, seconds given, value found)


@pytest.fixture
def fake(monkeypatch):
    def install(overrun: float, price: float = 0.0) -> FakeTime:
        ft = FakeTime(overrun, price)
        monkeypatch.setattr(Clock, "now", lambda self: ft.t)

        def solve(*args, time_limit, **kw):
            kw["milp"] = False
            res = real_solve(*args, time_limit=0.05, **kw)
            ft.calls.append((ft.t, time_limit, res.info.value))
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
    for when, given, _ in ft.calls[1:]:
        assert when + given + overrun <= end - max(0.02 * limit, 0.2) + 1e-9 or given <= plan_module._MIN_SOLVE_S
    assert ft.t <= end
    assert res.partition.time_s <= limit
    assert len(ft.calls) > 3  # the phases had time to run: baselines, quick solves, polish


def test_pricing_stops_at_its_share_and_the_bound_relaxes(fake):
    ft = fake(0.1, price=0.1)
    L = random_layers(6, 10)
    limit = 10.0
    t0 = ft.t
    res = plan(L, 4, 4, None, placement="one", time_limit=limit)
    # 165 cuts at 0.1 s each would take 16.5 s; every cut may be priced until half the limit,
    # then the local search has 15% of it
    assert not res.partition.exhaustive
    assert res.partition.cuts_bounded < 165
    assert ft.calls[0][0] <= t0 + (0.5 + 0.15) * limit + 3 * 0.1 * 4  # the local search's last step may finish
    assert ft.t <= t0 + limit


@pytest.mark.parametrize("objective", ["span", "makespan"])
def test_every_cut_is_priced_where_there_are_few_whatever_the_objective(fake, objective):
    # 84 cuts at 0.05 s each take 4.2 s: more than pricing's 15% of the limit, well within what
    # pricing every cut (there are fewer than ENUMERATE) may take
    ft = fake(0.1, price=0.05)
    L = random_layers(6, 8)
    res = plan(L, 4, 4, None, placement="one", time_limit=10.0, objective=objective)
    assert res.partition.exhaustive and res.partition.cuts_bounded == 84
    assert ft.t <= 1000.0 + 10.0


@pytest.mark.parametrize("layers, vocab, ranks, m", [(6, 1000, 2, 4), (10, 256000, 2, 8)])
def test_a_proven_plan_starts_no_solve_after_it_is_proven(fake, layers, vocab, ranks, m):
    """Once the best value found meets the bound over every cut, nothing can improve either:
    the plan returns, whatever time is left. The baselines are solved all the same (the plan
    reports them), each cut once."""
    ft = fake(0.1)
    L = llama_layers(layers, vocab=vocab, hidden=1024, heads=8, seq=1024)
    limit = 20.0
    res = plan(L, ranks, m, None, placement="one", time_limit=limit)
    part = res.partition
    assert part.gap <= CLOSED and part.exhaustive
    found = next(i for i, (_, _, value) in enumerate(ft.calls) if value <= part.value * (1 + 1e-12))
    baselines = len({(b.placement, tuple(b.units_per_stage)) for b in part.baselines if b.value is not None})
    assert len(ft.calls) == max(baselines, found + 1)
    when, given, _ = ft.calls[-1]
    assert ft.t == pytest.approx(when + given + 0.1)  # it returned after its last solve
    assert ft.t - 1000.0 < limit / 2


def test_pricing_a_cut_builds_no_more_models_for_the_makespan_than_for_the_span(monkeypatch):
    """The makespan's key is the span's per-rank bounds moved to where each rank can start: it
    costs no integer or linear program more than the span's, so as many cuts are priced."""
    import zbsearch._highs as highs

    built = {"n": 0}
    make = highs.quiet_highs

    def counted():
        built["n"] += 1
        return make()

    monkeypatch.setattr(highs, "quiet_highs", counted)
    for recompute in ("none", "auto"):
        L = random_layers(3, 5, recompute="both")
        static = max(max(static_bytes(L, Cut(c, "one"), "adamw")) for c in compositions(L.num_units, 3))
        models = {}
        for objective in ("span", "makespan"):
            built["n"] = 0
            space = Cuts(L, 3, "one", 4, static + 3e6, "adamw", objective, recompute)
            for counts in compositions(L.num_units, 3):
                space.evaluate(counts)
            assert sum(ev.feasible for ev in space.seen.values()) > 3
            models[objective] = built["n"]
        assert models["makespan"] <= models["span"], recompute


def test_a_limit_too_short_for_any_phase_still_solves_one_cut(fake):
    ft = fake(0.5)
    L = random_layers(7, 6)
    res = plan(L, 2, 4, None, placement="one", time_limit=0.5)
    assert len(ft.calls) >= 1 and res.partition.value > 0
