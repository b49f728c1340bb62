"""The split of a measured step's idle time (``zbsearch.idle_time``), checked on traces made from the
simulator's own timelines: a step that runs exactly as predicted waits only for dependencies,
as long as the simulator's gaps; a pass held back afterwards shows up, to the microsecond, as
a wait for its link (input from another rank) or as local overhead."""

from __future__ import annotations

import random

import pytest

import zbsearch as zb
from tests.helpers import make_profile
from zbsearch.dependencies import remote_input, remote_outputs
from zbsearch.errors import ZbError
from zbsearch.formats.trace import Trace, TraceArgs, TraceEvent, TraceInfo
from zbsearch.idle_time import measure_idle_time

KINDS = ["1f1b", "zb-h1", "zb-v", "gpipe"]


def _trace(sched: zb.Schedule, delay: dict[int, float] | None = None) -> Trace:
    """The simulated step as the runtime would record it; ``delay``: rank -> ms its last action
    starts (and ends) later than simulated."""
    tl = zb.timeline(sched)
    events = []
    for r, (acts, starts, ends) in enumerate(zip(tl.actions, tl.start, tl.end)):
        for i, (a, s, e) in enumerate(zip(acts, starts, ends)):
            shift = (delay or {}).get(r, 0.0) if i == len(acts) - 1 else 0.0
            events.append(TraceEvent(name=str(a), pid=r, ts=(s + shift) * 1e3, dur=(e - s) * 1e3,
                                     args=TraceArgs(stage=a.stage, op=a.op, mb=a.mb)))
    return Trace(traceEvents=events, zbsearch=TraceInfo(schedule_kind=sched.kind, num_ranks=sched.num_ranks))


def _schedules(n: int):
    rng = random.Random(7)
    for _ in range(n):
        p = rng.choice([2, 3, 4])
        times = [(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 1.5)) for _ in range(p)]
        prof = make_profile(p, stages=times, t_comm=rng.choice([0.0, 0.05, 0.3]))
        kind = rng.choice(KINDS)
        yield zb.build_classic(kind, prof, rng.choice([p, 2 * p, 2 * p + 1]))


@pytest.mark.parametrize("sched", list(_schedules(24)), ids=lambda s: f"{s.kind}-p{s.num_ranks}-m{s.num_microbatches}")
def test_a_step_as_simulated_waits_only_for_dependencies_as_long_as_the_simulator_gaps(sched):
    tl = zb.timeline(sched)
    t0 = min(s[0] for s in tl.start)
    waits = measure_idle_time(sched, [_trace(sched)])
    for w, starts, ends in zip(waits, tl.start, tl.end):
        gaps = (starts[0] - t0) + sum(s - e for s, e in zip(starts[1:], ends[:-1]))
        assert w.idle_ms == pytest.approx(gaps, abs=1e-6)
        assert w.dependency_ms == pytest.approx(gaps, abs=1e-6)
        assert w.link_ms == pytest.approx(0, abs=1e-6) and w.local_ms == pytest.approx(0, abs=1e-6)
        assert w.late_messages == 0


@pytest.mark.parametrize("sched", list(_schedules(24)), ids=lambda s: f"{s.kind}-p{s.num_ranks}-m{s.num_microbatches}")
def test_a_last_pass_held_back_is_a_link_wait_if_it_receives_from_another_rank_else_local(sched):
    exact = measure_idle_time(sched, [_trace(sched)])
    for r, row in enumerate(sched.rank_actions):
        if remote_outputs(row[-1], sched.stage_to_rank):
            continue  # holding it back would hold back its receiver too
        d = 0.25 * (r + 1)
        late = measure_idle_time(sched, [_trace(sched, {r: d}), _trace(sched, {r: d})])  # means over steps
        remote = remote_input(row[-1], sched.stage_to_rank) is not None
        for q, (a, b) in enumerate(zip(exact, late)):
            held = d if q == r else 0.0
            assert b.idle_ms == pytest.approx(a.idle_ms + held, abs=1e-6)
            assert b.dependency_ms == pytest.approx(a.dependency_ms, abs=1e-6)
            assert b.link_ms == pytest.approx(held if remote else 0.0, abs=1e-6)
            assert b.local_ms == pytest.approx(0.0 if remote else held, abs=1e-6)
            assert b.late_messages == (1 if remote and q == r else 0)
            assert b.link_excess_ms == pytest.approx((held,) * 3 if remote else (0.0,) * 3, abs=1e-6)


def test_a_trace_of_another_schedule_or_none_is_a_one_line_error():
    prof = make_profile(2)
    one, other = zb.build_classic("1f1b", prof, 4), zb.build_classic("zb-h1", prof, 4)
    with pytest.raises(ZbError, match="not a step of this schedule"):
        measure_idle_time(one, [_trace(other)])
    with pytest.raises(ZbError, match="no trace"):
        measure_idle_time(one, [])
