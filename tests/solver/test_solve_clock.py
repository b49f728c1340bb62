"""A solve keeps its time limit where each schedule costs a large part of it, on a simulated clock.

On thousands of passes one simulation or one classic build takes a large part of a second, so a
solve given less than that must not go on building candidates once its deadline has passed:
it keeps the first schedule in hand (the least-memory classic order, else the sequential one).
Here the clock the solver's budget, its construction and the classic builders read
(``zbsearch.clock.now``) is a counter that each simulation and each classic build advances;
nothing else moves it, so no wall time is measured.
"""

from __future__ import annotations

import importlib
import random

import pytest

from tests.solver.oracle import random_instance, with_recompute
from zbsearch import clock
from zbsearch.classic import ClassicKind
from zbsearch.solver import solve
from zbsearch.solver.problem import Problem
from zbsearch.validator import find_problem

construct_module = importlib.import_module("zbsearch.solver.construct")

SIM, BUILD = 3.0, 2.0  # simulated seconds per simulation and per classic build (98k passes, loaded)


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0
        self.sims = self.builds = 0


@pytest.fixture
def fake(monkeypatch):
    ft = FakeTime()
    monkeypatch.setattr(clock, "now", lambda: ft.t)
    evaluate = Problem.evaluate

    def timed(self, rows):
        ft.t += SIM
        ft.sims += 1
        return evaluate(self, rows)

    monkeypatch.setattr(Problem, "evaluate", timed)
    build_by = ClassicKind.build_by

    def built(self, cost, m, deadline=None):
        ft.t += BUILD
        ft.builds += 1
        return build_by(self, cost, m, deadline)

    monkeypatch.setattr(ClassicKind, "build_by", built)
    return ft


@pytest.mark.parametrize("chunks, limit", [(1, "min"), (2, "min"), (1, "1p"), (2, "1p")])
@pytest.mark.parametrize("recompute", ["auto", "full", "none"])
def test_a_solve_past_its_deadline_builds_little_more(fake, chunks, limit, recompute):
    rng = random.Random(7 * chunks + len(limit))
    inst = random_instance(rng, "hetero", 4, 8, chunks, limit)
    if recompute != "none":
        inst = with_recompute(rng, inst, selective=True)
    t0 = fake.t
    res = solve(inst.profile, inst.m, inst.limit, chunks=chunks, time_limit=0.1, recompute=recompute)
    assert find_problem(res.schedule) is None
    # past the deadline (at once: the first simulation passes it), at most: the least-memory
    # classic order built and simulated, the sequential one simulated, the result timed again
    assert fake.builds <= 2, (fake.builds, fake.sims)
    assert fake.sims <= 3, (fake.builds, fake.sims)
    assert fake.t - t0 <= 0.1 + 2 * BUILD + 3 * SIM
