"""dependencies: successors, reachability and earliest starts against brute force on the rule."""

import pytest

from tests.helpers import make_profile
from zbsearch import CostModel
from zbsearch.actions import Action, Op
from zbsearch.dependencies import (
    ACT,
    GRAD,
    earliest_starts,
    inputs_from_other_stages,
    must_precede,
    outputs_to_other_stages,
    pass_types,
    predecessors,
    successors,
)


@pytest.mark.parametrize("S", [1, 2, 3, 6])
def test_successors_invert_predecessors_and_reachability_is_the_closure(S):
    types = pass_types(S)
    for s, op in types:
        for ds, dop, j in predecessors(s, op, 3, S):
            assert (s, op, 3) in successors(ds, dop, j, S)
            assert types.index((ds, dop)) < types.index((s, op))  # pass_types is topological
        for ns, nop, j in successors(s, op, 3, S):
            assert (s, op, 3) in predecessors(ns, nop, j, S)
    for a in types:  # depth-first search over predecessors, from every b back to a
        for b in types:
            seen, stack = set(), [b]
            while stack:
                for ds, dop, _ in predecessors(*stack.pop(), 0, S):
                    if (ds, dop) not in seen:
                        seen.add((ds, dop))
                        stack.append((ds, dop))
            assert must_precede(a, b, S) == (a in seen)


def test_earliest_starts_follow_the_chain():
    prof = make_profile(3, stages=[(1.0, 2.0, 0.5), (1.5, 2.5, 0.7), (2.0, 3.0, 0.9)], t_comm=0.25)
    cost = CostModel.from_profile(prof, [0, 1, 2])
    rel = earliest_starts(cost, (1, Op.F))
    assert rel[(0, Op.F)] == float("-inf")  # not reachable from F(1)
    assert rel[(2, Op.F)] == pytest.approx(1.5 + 0.25)
    assert rel[(1, Op.B)] == pytest.approx(1.5 + 0.25 + 2.0 + 3.0 + 0.25)  # up to the last stage, back down
    assert rel[(1, Op.W)] == pytest.approx(rel[(1, Op.B)] + 2.5)


def test_tensors_between_stages():
    S = 4
    assert [t.key for t in inputs_from_other_stages(Action(2, Op.F, 5), S)] == [(ACT, 1, 5)]
    assert [t.key for t in outputs_to_other_stages(Action(2, Op.F, 5), S)] == [(ACT, 2, 5)]
    assert [t.key for t in inputs_from_other_stages(Action(2, Op.BW, 5), S)] == [(GRAD, 2, 5)]
    assert [t.key for t in outputs_to_other_stages(Action(2, Op.B, 5), S)] == [(GRAD, 1, 5)]
    assert inputs_from_other_stages(Action(3, Op.B, 0), S) == []  # the loss starts the backward
    assert outputs_to_other_stages(Action(0, Op.BW, 0), S) == [] == outputs_to_other_stages(Action(1, Op.W, 0), S)
