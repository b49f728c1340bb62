"""The simulator against an obviously correct slow one, on generated schedules.

The reference (``tests.helpers.reference``) re-reads the rules of the module docstring of
``zbsearch.simulator`` straight from ``dependencies.predecessors``: sweep the ranks round-robin,
run a rank's next action whenever every pass it needs has run, until no rank can move. The fast
simulator (one pass in dependency order over resolved tables) must give the same Timeline,
float for float, and the same errors: the same Deadlock waits, the same missing-dependency message.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.reference import mutate, outcome, random_cost, random_order, reference
from zbsearch.actions import Action, Op
from zbsearch.classic import KINDS
from zbsearch.errors import ZbError
from zbsearch.simulator import Deadlock, simulate


@st.composite
def _cases(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    p = draw(st.integers(1, 4))
    chunks, layout = draw(st.sampled_from([(1, "looped"), (2, "v"), (2, "looped")]))
    cost = random_cost(rng, p, chunks, layout)
    rows = random_order(rng, cost, draw(st.integers(1, 5)), fuse=draw(st.sampled_from([0.0, 0.3])))
    if draw(st.booleans()):
        rows = mutate(rng, rows)
    return rows, cost


@given(_cases())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_same_as_reference(case):
    rows, cost = case
    assert outcome(simulate, rows, cost) == outcome(reference, rows, cost)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 7)])
def test_classic_orders_same_as_reference(kind, p, m):
    rng = random.Random(p * 100 + m)
    spec = KINDS[kind]
    cost = random_cost(rng, p, spec.chunks, spec.layout)
    try:
        rows = spec.build(cost, m)
    except ZbError:  # e.g. interleaved needs m a multiple of p
        return
    out = outcome(simulate, rows, cost)
    assert out[0] == "ok"
    assert out == outcome(reference, rows, cost)


def test_deadlock_reports_each_stuck_rank():
    cost = random_cost(random.Random(0), 2, 1, "looped")
    rows = [[Action(0, Op.F, 0), Action(0, Op.B, 0), Action(0, Op.W, 0)],
            [Action(1, Op.B, 0), Action(1, Op.F, 0), Action(1, Op.W, 0)]]
    with pytest.raises(Deadlock) as e:
        simulate(rows, cost)
    # rank 1 waits on itself (its B before its F); rank 0 waits for rank 1's B
    assert e.value.waits == [(0, Action(0, Op.B, 0), Action(1, Op.B, 0), 1), (1, Action(1, Op.B, 0), Action(1, Op.F, 0), 1)]
