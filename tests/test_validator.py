"""The validator rejects each kind of broken schedule and names the offending action."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import make_profile
from tests.helpers.reference import mutate, random_order, random_profile, reference_problem
from zbsearch import (
    CLASSIC_KINDS,
    CostModel,
    InvalidSchedule,
    Schedule,
    build_classic,
    find_problem,
    makespan_lower_bound,
    simulate,
    span_lower_bound,
    timeline,
    validate,
)
from zbsearch.errors import ZbError
from zbsearch.formats.edit import updated
from zbsearch.layout import placement
from zbsearch.validator import _wait_cycle


def _edit(sched, rows):
    return updated(sched, actions=rows)


@pytest.fixture
def base():
    return build_classic("zb-h1", make_profile(3), 6)


def _rows(sched):
    return [list(r) for r in sched.actions]


def test_valid_schedule_passes(base):
    assert find_problem(base) is None
    validate(base)


def test_missing_action(base):
    rows = _rows(base)
    rows[1].remove("1W4")
    assert find_problem(_edit(base, rows)) == "1W4 is missing (rank 1 never runs it)"


def test_duplicate_action(base):
    rows = _rows(base)
    rows[2].append("2F1")
    msg = find_problem(_edit(base, rows))
    assert msg.startswith("2F1 is done twice")


def test_fused_and_split_backward_count_as_duplicate(base):
    rows = _rows(base)
    rows[0].append("0BW0")
    assert "0B0 is done twice" in find_problem(_edit(base, rows))


def test_wrong_rank(base):
    rows = _rows(base)
    rows[0].remove("0F2")
    rows[1].insert(0, "0F2")
    assert find_problem(_edit(base, rows)).startswith("0F2 is on rank 1 (position 0) but stage 0 lives on rank 0")


def test_b_before_its_f(base):
    rows = _rows(base)
    i, j = rows[2].index("2F1"), rows[2].index("2B1")
    rows[2][i], rows[2][j] = rows[2][j], rows[2][i]
    assert "2B1 at position" in find_problem(_edit(base, rows)) and "which it depends on" in find_problem(_edit(base, rows))


def test_cross_rank_deadlock():
    sched = build_classic("1f1b", make_profile(2), 2)
    # rank 0 waits for the gradient of mb 0 before sending mb 1's activation; rank 1 wants mb 1 first.
    rows = [["0F0", "0BW0", "0F1", "0BW1"], ["1F1", "1BW1", "1F0", "1BW0"]]
    msg = find_problem(_edit(sched, rows))
    assert msg.startswith("deadlock:") and "(rank 0)" in msg and "(rank 1)" in msg
    with pytest.raises(InvalidSchedule):
        validate(_edit(sched, rows))


def test_memory_overflow():
    sched = build_classic("gpipe", make_profile(2), 4)
    assert find_problem(sched, memory_limit=[4.0, 4.0]) is None
    msg = find_problem(sched, memory_limit=[3.5, 4.0])
    assert msg == "rank 0: memory reaches 4 after 0F3 (position 3), over its limit 3.5"


costs = st.tuples(st.floats(0.2, 3.0), st.floats(0.2, 3.0), st.floats(0.0, 3.0))


@st.composite
def problems(draw):
    p = draw(st.integers(1, 8))
    m = draw(st.integers(1, 24))
    stages = draw(st.lists(costs, min_size=p, max_size=p))
    comm = draw(st.sampled_from([0.0, 0.05, 0.3]))
    return make_profile(p, stages=stages, t_comm=comm), m


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(CLASSIC_KINDS), st.floats(0.0, 1.0))
def test_property_classic_schedules_are_valid_and_above_bounds(problem, kind, keep):
    prof, m = problem
    p = prof.num_stages
    if kind == "interleaved-1f1b":
        m = max(p, m - m % p)
    if kind == "dualpipe-v":  # its F&B pairs need two microbatches per virtual stage pair
        m = max(m, 2 * p)
    if kind.endswith("-recompute"):  # these recompute every microbatch: the profile must offer it
        prof = make_profile(p, stages=[(s.t_f, s.t_b, s.t_w) for s in prof.stages], t_comm=prof.t_comm, keep=keep)
    sched = build_classic(kind, prof, m)
    assert find_problem(sched) is None
    tl = timeline(sched)
    cost = CostModel.from_profile(prof, sched.stage_to_rank)
    assert max(tl.span) >= span_lower_bound(cost, m) - 1e-9
    assert tl.makespan >= makespan_lower_bound(cost, m) - 1e-9
    assert max(tl.span) >= max(tl.busy) - 1e-9


@settings(max_examples=40, deadline=None)
@given(problems())
def test_property_split_1f1b_never_slower_than_1f1b(problem):
    prof, m = problem
    f1 = build_classic("1f1b", prof, m)
    split = build_classic("1f1b-split", prof, m)
    assert max(split.predicted.span) <= max(f1.predicted.span) + 1e-9
    assert max(split.predicted.peak_memory) <= max(f1.predicted.peak_memory) + 1e-9



@st.composite
def _schedules(draw):
    """A random schedule (1 or 2 chunks, fused backwards), often broken, with a memory limit."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    chunks, layout = draw(st.sampled_from([(1, "looped"), (2, "v")]))
    prof = random_profile(rng, p)
    cost = CostModel.from_profile(prof, placement(p, chunks, layout))
    rows = random_order(rng, cost, m, fuse=draw(st.sampled_from([0.0, 0.3])))
    if draw(st.booleans()):
        rows = mutate(rng, rows)
    if p > 1 and draw(st.integers(0, 4)) == 0:  # an action on another rank
        r = rng.randrange(p)
        if rows[r]:
            rows[(r + 1) % p].append(rows[r].pop(rng.randrange(len(rows[r]))))
    x = draw(st.sampled_from([None, 0.5, 1.0, 2.0]))
    limit = None if x is None else [x * p * max(cost.activation_unit(r), 0.1) for r in range(p)]
    return Schedule.build("gen", prof, m, list(cost.stage_to_rank), rows, memory_limit=limit), cost


@given(_schedules())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_same_verdict_as_reference(case):
    """find_problem names the same first problem as the checks of its docstring applied one at
    a time; handed the timeline, it gives the same verdict on every schedule that runs."""
    sched, cost = case
    rows = sched.rank_actions
    expected = reference_problem(rows, sched.stage_to_rank, sched.num_microbatches, cost, sched.memory_limit, _wait_cycle)
    assert find_problem(sched) == expected
    try:
        tl = simulate(rows, cost)
    except ZbError:
        return
    assert find_problem(sched, timeline=tl) == expected
