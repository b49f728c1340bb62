"""The fused backward's own time (t_bw): old profiles still load with BW = t_b + t_w, the
simulator charges t_bw, and every lower bound stays below every schedule, fused, split or mixed,
whether a fused backward (and the forward before it, t_ff) is cheaper than the split (the usual
case) or not."""

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_profile
from tests.helpers.reference import fuse_some
from zbsearch import CostModel, Profile, build_classic, load_profile, timeline
from zbsearch.actions import Op
from zbsearch.bounds import (
    makespan_lower_bound,
    memory_makespan_lower_bound,
    memory_span_lower_bound,
    span_lower_bound,
)
from zbsearch.formats.edit import updated

EPS = 1e-9


def test_profile_without_t_bw_loads_and_bw_costs_b_plus_w(tmp_path):
    old = {
        "format": "zbsearch.profile", "version": 1, "name": "old", "memory_unit": "activations",
        "stages": [{"t_f": 1.0, "t_b": 1.5, "t_w": 0.75, "m_f": 1.0, "m_b": -0.6, "m_w": -0.4}] * 2,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    prof = load_profile(path)
    assert prof.stages[0].t_bw is None
    cost = CostModel.from_profile(prof, [0, 1])
    assert cost.time(1, Op.BW) == 1.5 + 0.75
    assert cost.for_bounds() is cost


def _with_bw(prof: Profile, t_bw: list[float]) -> Profile:
    return updated(prof, stages=[updated(s, t_bw=bw) for s, bw in zip(prof.stages, t_bw)])


def test_simulator_charges_t_bw_for_fused_passes():
    prof = _with_bw(make_profile(2, t_f=1.0, t_b=1.0, t_w=1.0), [1.5, 1.25])
    m = 4
    tl = timeline(build_classic("1f1b", prof, m))
    assert tl.busy == [m * (1.0 + 1.5), m * (1.0 + 1.25)]
    split = timeline(build_classic("zb-h1", prof, m))
    assert split.busy == [m * 3.0, m * 3.0]  # B and W keep their own times
    # each rank holds half of each profile stage: half of each stage's t_f + t_bw
    halved = timeline(build_classic("interleaved-1f1b", prof, m, 2))
    assert halved.busy == [m * (1.0 + (1.5 + 1.25) / 2)] * 2


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(1, 6), st.data())
def test_bounds_hold_for_fused_split_and_mixed_schedules(p, m, data):
    times = [(data.draw(st.floats(0.3, 2.0)), data.draw(st.floats(0.3, 2.0)), data.draw(st.floats(0.0, 1.5))) for _ in range(p)]
    # t_bw from well below t_b (a split that costs a lot) to above t_b + t_w
    t_bw = [data.draw(st.floats(0.2, 1.3)) * (b + w) for _, b, w in times]
    # the forward before a fused backward: well below t_f to a little above it
    t_ff = [data.draw(st.floats(0.5, 1.2)) * f for f, _, _ in times]
    prof = _with_bw(make_profile(p, stages=times, m_w=data.draw(st.floats(0.0, 1.0)),
                                 t_comm=data.draw(st.sampled_from([0.0, 0.3]))), t_bw)
    prof = updated(prof, stages=[updated(s, t_ff=ff) for s, ff in zip(prof.stages, t_ff)])
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    for kind, chunks in [
        ("gpipe", None),
        ("1f1b", None),
        ("interleaved-1f1b", 2),
        ("zb-h1", None),
        ("zb-h2", None),
        ("zb-v", None),
    ]:
        if kind == "interleaved-1f1b" and m % p:
            continue
        sched = build_classic(kind, prof, m, chunks)
        for variant in (sched, fuse_some(sched, rng)):
            cost = CostModel.from_profile(prof, variant.stage_to_rank)
            tl = timeline(variant)
            span = max(tl.span)
            assert span_lower_bound(cost, m) <= span + EPS, (kind, variant.actions)
            assert makespan_lower_bound(cost, m) <= tl.makespan + EPS, (kind, variant.actions)
            assert all(cost.rank_busy(r, m) <= busy + EPS for r, busy in enumerate(tl.busy)), (kind, variant.actions)
            peak = [max(x, 1e-9) for x in tl.peak_memory]
            assert memory_span_lower_bound(cost, m, peak) <= span + EPS, (kind, variant.actions)
            assert memory_makespan_lower_bound(cost, m, peak) <= tl.makespan + EPS, (kind, variant.actions)
