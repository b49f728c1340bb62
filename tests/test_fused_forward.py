"""The forward of a microbatch whose backward is fused (t_ff): old profiles load with every F at
t_f, a schedule's F costs t_ff exactly where its rank runs that microbatch's backward as one BW,
and the simulator agrees with a slow reference that prices each action by that rule (written
in ``tests.helpers.reference``) on classic, partly fused and random schedules."""

import json
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.helpers import make_profile
from tests.helpers.reference import fuse_some, outcome, random_order, reference
from zbsearch import CostModel, Profile, StageCost, build_classic, load_profile, resolve_profile, simulate, timeline
from zbsearch.actions import Action, Op
from zbsearch.formats.edit import updated
from zbsearch.formats.profile import BUNDLED_PROFILES
from zbsearch.formats.schedule import Schedule
from zbsearch.formats.trace import Trace
from zbsearch.pass_times import compare_pass_times

KINDS = [("gpipe", None), ("1f1b", None), ("1f1b-split", None), ("interleaved-1f1b", 2), ("zb-h1", None),
         ("zb-h2", None), ("zb-v", None)]


def _with(prof: Profile, **per_stage: list[float]) -> Profile:
    return updated(prof, stages=[updated(s, **{k: v[i] for k, v in per_stage.items()}) for i, s in enumerate(prof.stages)])


def test_profile_without_t_ff_loads_and_every_f_costs_t_f(tmp_path):
    old = {
        "format": "zbsearch.profile", "version": 1, "name": "old", "memory_unit": "activations",
        "stages": [{"t_f": 1.25, "t_b": 1.5, "t_w": 0.75, "t_bw": 2.0, "m_f": 1.0, "m_b": -0.6, "m_w": -0.4}] * 2,
        "t_send": 0.125, "t_recv": 0.0625,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    prof = load_profile(path)
    assert prof.stages[0].t_ff is None and prof.stages[0].fused_forward == 1.25
    cost = CostModel.from_profile(prof, [0, 1])
    assert cost.t_ff == cost.t_f  # the host time of messages included, as for t_f
    m = 4
    tl = timeline(build_classic("1f1b", prof, m))
    assert tl.busy == [m * (1.25 + 0.125 + 2.0 + 0.0625), m * (1.25 + 0.0625 + 2.0 + 0.125)]


@pytest.mark.parametrize("path", sorted(BUNDLED_PROFILES.rglob("*.json")), ids=lambda p: p.stem)
def test_bundled_profiles_predate_t_ff_and_time_every_f_at_t_f(path):
    """Timelines of profiles without t_ff are those of a model that prices every pass by its
    type alone, as before t_ff existed."""
    prof = resolve_profile(str(path))
    if any(s.t_ff is not None for s in prof.stages):
        pytest.skip("measured with t_ff")
    p = prof.num_ranks
    for kind, chunks in [("1f1b", None), ("gpipe", None), ("interleaved-1f1b", 2)]:
        if prof.placement is not None and kind != "1f1b":
            continue
        sched = build_classic(kind, prof, 2 * p, chunks if prof.placement is None else None)
        cost = CostModel.from_profile(sched.profile, sched.stage_to_rank)
        tl = simulate(sched.rank_actions, cost)
        by_type = [[cost.time(a.stage, a.op) for a in row] for row in sched.rank_actions]
        assert tl.busy == [sum(row) for row in by_type]
        took = [e - s for starts, ends in zip(tl.start, tl.end) for s, e in zip(starts, ends)]
        assert took == pytest.approx([d for row in by_type for d in row], abs=1e-9)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e10])
def test_t_ff_is_validated_like_the_other_times(bad):
    with pytest.raises(ValidationError):
        StageCost(t_f=1.0, t_b=1.0, t_w=1.0, t_ff=bad, m_f=1.0, m_b=-0.5, m_w=-0.5)


def test_f_costs_t_ff_only_where_its_rank_fuses_that_microbatchs_backward():
    prof = _with(make_profile(2, t_f=1.0, t_b=1.0, t_w=1.0), t_ff=[0.75, 0.5], t_bw=[1.5, 1.25])
    m = 4
    assert timeline(build_classic("1f1b", prof, m)).busy == [m * (0.75 + 1.5), m * (0.5 + 1.25)]
    assert timeline(build_classic("gpipe", prof, m)).busy == [m * (0.75 + 1.5), m * (0.5 + 1.25)]
    assert timeline(build_classic("zb-h1", prof, m)).busy == [m * 3.0, m * 3.0]  # no BW: every F is split
    # each rank holds half of each profile stage
    halved = timeline(build_classic("interleaved-1f1b", prof, m, 2))
    assert halved.busy == [m * ((0.75 + 0.5) / 2 + (1.5 + 1.25) / 2)] * 2
    # one microbatch fused per rank: its F alone costs t_ff
    rows = [[Action(0, Op.F, j) for j in range(m)] + [Action(0, Op.BW, 0)]
            + [Action(0, op, j) for j in range(1, m) for op in (Op.B, Op.W)],
            [x for j in range(m) for x in ([Action(1, Op.F, j), Action(1, Op.BW, j)] if j == 2 else
                                            [Action(1, Op.F, j), Action(1, Op.B, j), Action(1, Op.W, j)])]]
    cost = CostModel.from_profile(prof, [0, 1])
    durations = cost.durations(rows)
    assert [d for a, d in zip(rows[0], durations[0]) if a.op is Op.F] == [0.75, 1.0, 1.0, 1.0]
    assert [d for a, d in zip(rows[1], durations[1]) if a.op is Op.F] == [1.0, 1.0, 0.5, 1.0]
    # a repeated F (a broken schedule the validator refuses) is priced like the runtime runs it: each at t_ff
    assert cost.durations([[Action(0, Op.F, 1), Action(0, Op.BW, 1), Action(0, Op.F, 1)]]) == [[0.75, 1.5, 0.75]]
    assert simulate(rows, cost).busy == [0.75 + 3 * 1.0 + 1.5 + 3 * 2.0, 0.5 + 3 * 1.0 + 1.25 + 3 * 2.0]


def _profile(data, p: int) -> Profile:
    """Unequal stages whose forward before a fused backward is cheaper than t_f (the usual case)."""
    def t(lo: float, hi: float) -> float:
        return round(data.draw(st.floats(lo, hi)), 3)

    stages = []
    for _ in range(p):
        t_f = t(0.3, 2.0)
        stages.append(StageCost(t_f=t_f, t_b=t(0.3, 2.0), t_w=t(0.0, 1.5), t_bw=t(0.3, 3.0), t_ff=round(t_f * t(0.6, 0.99), 4),
                                m_f=1.0, m_b=-0.6, m_w=-0.4))
    comm = data.draw(st.sampled_from([0.0, 0.25]))
    host = data.draw(st.sampled_from([None, 0.125]))
    return Profile(name="ff", memory_unit="activations", stages=stages, t_comm=comm, t_send=host, t_recv=host)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.integers(1, 6), st.data())
def test_simulator_prices_fused_forwards_as_the_reference_does(p, m, data):
    prof = _profile(data, p)
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    for kind, chunks in KINDS:
        if kind == "interleaved-1f1b" and m % p:
            continue
        sched = build_classic(kind, prof, m, chunks)
        cost = CostModel.from_profile(prof, sched.stage_to_rank)
        for rows in (sched.rank_actions, fuse_some(sched, rng).rank_actions, random_order(rng, cost, m, fuse=0.5)):
            got = outcome(simulate, rows, cost)
            assert got[0] == "ok"
            assert got == outcome(reference, rows, cost), (kind, rows)
            # the rule moves the timeline exactly where some F precedes a fused backward
            fused = any(a.op is Op.BW for row in rows for a in row)
            split_priced = outcome(reference, rows, replace(cost, t_ff=cost.t_f))  # every F at t_f, as before t_ff
            assert (got == split_priced) == (not fused or cost.t_ff == cost.t_f), (kind, rows)


def test_pass_report_predicts_t_ff_for_the_forwards_of_fused_microbatches():
    """``compare_pass_times`` predicts per action by the same rule: a trace whose F passes took
    exactly their profiled times reads 1.0 on every pass type."""
    prof = _with(make_profile(1, t_f=2.0, t_b=1.5, t_w=1.0), t_ff=[1.5], t_bw=[2.0])
    m = 4
    rows = [[Action(0, Op.F, 0), Action(0, Op.BW, 0), Action(0, Op.F, 1), Action(0, Op.B, 1), Action(0, Op.W, 1),
             Action(0, Op.F, 2), Action(0, Op.BW, 2), Action(0, Op.F, 3), Action(0, Op.B, 3), Action(0, Op.W, 3)]]
    sched = Schedule.build("mixed", prof, m, [0], rows)
    truth = {Op.B: 1.5, Op.W: 1.0, Op.BW: 2.0}
    events, t = [], 0.0
    for a in rows[0]:
        dur = (1.5 if a.mb in (0, 2) else 2.0) if a.op is Op.F else truth[a.op]
        events.append({"name": str(a), "ph": "X", "pid": 0, "tid": 0, "ts": t * 1e3, "dur": dur * 1e3,
                       "args": {"stage": a.stage, "op": a.op.value, "mb": a.mb}})
        t += dur
    trace = Trace.model_validate({"traceEvents": events, "zbsearch": {"schedule_kind": "mixed", "num_ranks": 1}})
    rows_out = compare_pass_times(sched, [trace])
    f = next(x for x in rows_out if x.op is Op.F)
    assert f.predicted_ms == pytest.approx((1.5 + 2.0 + 1.5 + 2.0) / 4)
    assert all(x.ratio == pytest.approx(1.0) for x in rows_out)
