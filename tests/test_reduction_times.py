"""Measured against predicted reductions (``zbsearch.reduction_times``), on traces made from the
simulator's own timelines with its reduction lane: a step that runs as predicted compares equal,
and a reduction held back shows up as a later start, to the microsecond."""

from __future__ import annotations

import json
import subprocess

import pytest

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.formats.trace import Trace, TraceArgs, TraceEvent, TraceInfo
from zbsearch.reduction_times import compare_reductions
from zbsearch.reductions import with_reductions


def _sched(kind: str) -> zb.Schedule:
    prof = zb.resolve_profile("1.5b-m24")
    prof = with_reductions(prof, 16, 25.0, [3e8 + 5e7 * s for s in range(prof.num_stages)])
    return zb.build_classic(kind, prof, 8)


def _trace(sched: zb.Schedule, late: float = 0.0) -> Trace:
    """The simulated step as the runtime records it; rank 0's reductions ``late`` ms later."""
    tl = zb.timeline(sched)
    events = [TraceEvent(name=str(a), pid=r, ts=s * 1e3, dur=(e - s) * 1e3, args=TraceArgs(stage=a.stage, op=a.op, mb=a.mb))
              for r in range(tl.num_ranks) for a, s, e in zip(tl.actions[r], tl.start[r], tl.end[r])]
    lanes = [[(s, (a + (late if r == 0 else 0.0)) * 1e3, (b + (late if r == 0 else 0.0)) * 1e3) for s, a, b in lane]
             for r, lane in enumerate(tl.reductions)]
    return Trace(traceEvents=events, zbsearch=TraceInfo(schedule_kind=sched.kind, num_ranks=sched.num_ranks,
                                                        reductions=lanes))


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_a_step_run_as_predicted_compares_equal(kind):
    sched = _sched(kind)
    got = compare_reductions(sched, [_trace(sched), _trace(sched)])
    assert len(got) == sched.num_stages and all(x.count == 2 for x in got)
    for x in got:
        assert x.measured_ms == pytest.approx(x.predicted_ms, abs=1e-6)
        assert x.measured_delay_ms == pytest.approx(x.predicted_delay_ms, abs=1e-6)


def test_a_late_reduction_shows_as_a_later_start():
    sched = _sched("zb-h1")
    got = {(x.rank, x.stage): x for x in compare_reductions(sched, [_trace(sched, late=2.5)])}
    assert got[(0, 0)].measured_delay_ms - got[(0, 0)].predicted_delay_ms == pytest.approx(2.5, abs=1e-6)
    assert got[(1, 1)].measured_delay_ms == pytest.approx(got[(1, 1)].predicted_delay_ms, abs=1e-6)


def test_traces_without_reductions_compare_nothing_and_simulate_prints_the_table(tmp_path):
    sched = _sched("zb-v")
    plain = _trace(sched).model_copy(update={"zbsearch": TraceInfo(schedule_kind="zb-v", num_ranks=sched.num_ranks)})
    assert compare_reductions(sched, [plain]) == []
    (tmp_path / "s.json").write_text(sched.model_dump_json())
    (tmp_path / "t.json").write_text(json.dumps(_trace(sched).model_dump(mode="json")))
    r = subprocess.run([*cli_command(), "simulate", str(tmp_path / "s.json"), "--measured", str(tmp_path / "t.json")],
                       capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "data-parallel reductions" in r.stdout


# ---- sharded stages: gathers and where each rank's step ends, against values worked out by hand ----

def _sharded_1f1b() -> zb.Schedule:
    """1F1B, 2 stages, 2 microbatches, every pass 1 ms (fused backward: 2 ms), no link time; stage
    0 gathers in 2 ms and reduces in 4, stage 1 in 3 and 5. By hand: rank 0 gathers [0, 2], runs
    F0 2-3, F1 3-4, BW0 6-8, BW1 9-11, reduces [11, 15]; rank 1 gathers [0, 3], runs F0 3-4,
    BW0 4-6, F1 6-7, BW1 7-9, reduces [9, 14]."""
    from tests.helpers.toy import uniform_profile

    prof = uniform_profile(2)
    prof = prof.model_copy(update={"stages": [st.model_copy(update={"t_gather": g, "t_reduce": r})
                                              for st, g, r in zip(prof.stages, [2.0, 3.0], [4.0, 5.0])]})
    sched = zb.build_classic("1f1b", prof, 2)
    assert [[str(a) for a in row] for row in sched.rank_actions] == [["0F0", "0F1", "0BW0", "0BW1"],
                                                                       ["1F0", "1BW0", "1F1", "1BW1"]]
    return sched


def _measured(gathers: bool = True) -> Trace:
    """A step as a runtime might record it, in ms from rank 0's first pass: rank 0 issues its gather
    2.2 ms before it and sees it complete 0.1 ms before; rank 1 issues 2.0 ms before and sees it
    complete at 1.2 ms (1000 and 2000 bytes)."""
    passes = {0: [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("BW", 0, 4.0, 6.0), ("BW", 1, 7.6, 9.6)],
              1: [("F", 0, 1.5, 2.5), ("BW", 0, 2.5, 4.5), ("F", 1, 4.5, 5.5), ("BW", 1, 5.5, 7.5)]}
    events = [TraceEvent(name=f"{r}{op}{mb}", pid=r, ts=a * 1e3, dur=(b - a) * 1e3, args=TraceArgs(stage=r, op=op, mb=mb))
              for r, rows in passes.items() for op, mb, a, b in rows]
    info = TraceInfo(schedule_kind="1f1b", num_ranks=2, reductions=[[(0, 9700.0, 14000.0)], [(1, 7600.0, 12900.0)]],
                     gathers=[[(0, -2200.0, -100.0, 1000.0)], [(1, -2000.0, 1200.0, 2000.0)]] if gathers else None)
    return Trace(traceEvents=events, zbsearch=info)


def test_gathers_and_the_steps_end_compare_with_the_lane_worked_out_by_hand():
    from zbsearch.reduction_times import compare_gathers, compare_lane_ends

    sched = _sharded_1f1b()
    got = compare_gathers(sched, [_measured(), _measured()])
    assert [(x.rank, x.stage, x.count, x.bytes) for x in got] == [(0, 0, 2, 1000.0), (1, 1, 2, 2000.0)]
    # measured: issued to complete, complete to the first pass; predicted: the lane from the step's start
    assert [(x.measured_ms, x.measured_slack_ms) for x in got] == [pytest.approx((2.1, 0.1)), pytest.approx((3.2, 0.3))]
    assert [(x.predicted_ms, x.predicted_slack_ms) for x in got] == [(2.0, 0.0), (3.0, 0.0)]
    # from the first gather issued (-2.2 ms): rank 0's reduction ends at 14.0, rank 1's at 12.9; predicted 15 and 14
    ends = compare_lane_ends(sched, [_measured()])
    assert [(x.rank, x.count) for x in ends] == [(0, 1), (1, 1), (None, 1)]
    assert [x.measured_ms for x in ends] == pytest.approx([16.2, 15.1, 16.2])
    assert [x.predicted_ms for x in ends] == pytest.approx([15.0, 14.0, 15.0])
    # rank 1 starting its step 3 ms earlier (done early with the previous one) moves neither: the
    # step starts with rank 0, which runs its first pass; rank 1's gather now took 6.2 ms from its issue
    early = _measured()
    early.zbsearch.gathers[1][0] = (1, -5000.0, 1200.0, 2000.0)
    assert [x.measured_ms for x in compare_lane_ends(sched, [early])] == pytest.approx([16.2, 15.1, 16.2])
    assert compare_gathers(sched, [early])[1].measured_ms == pytest.approx(6.2)
    # without gathers both count from the first pass: rank 0's at 0 measured, at 2 ms predicted
    plain = compare_lane_ends(sched, [_measured(gathers=False)])
    assert [x.measured_ms for x in plain] == pytest.approx([14.0, 12.9, 14.0])
    assert [x.predicted_ms for x in plain] == pytest.approx([13.0, 12.0, 13.0])
    assert compare_gathers(sched, [_measured(gathers=False)]) == []


def test_simulate_measured_shows_the_gathers_and_says_so_in_one_line_where_a_trace_has_none(tmp_path):
    sched = _sharded_1f1b()
    (tmp_path / "s.json").write_text(sched.model_dump_json())
    for name, trace in (("with.json", _measured()), ("without.json", _measured(gathers=False))):
        (tmp_path / name).write_text(json.dumps(trace.model_dump(mode="json")))
    env = {**__import__("os").environ, "COLUMNS": "250"}

    def simulate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli_command(), "simulate", str(tmp_path / "s.json"), *args], capture_output=True, text=True,
                              env=env)

    r = simulate("--measured", str(tmp_path / "with.json"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(g["rank"], g["stage"], g["bytes"]) for g in doc["gathers"]] == [(0, 0, 1000.0), (1, 1, 2000.0)]
    assert doc["gathers"][1]["measured_ms"] == pytest.approx(3.2) and doc["gathers"][1]["predicted_ms"] == 3.0
    assert doc["lane_ends"][-1] == {"rank": None, "count": 1, "measured_ms": pytest.approx(16.2), "predicted_ms": 15.0}
    assert [x["stage"] for x in doc["reductions"]] == [0, 1] and doc["note"] is None
    r = simulate("--measured", str(tmp_path / "with.json"))
    assert r.returncode == 0, r.stderr
    assert "parameter gathers of sharded stages" in r.stdout and "reduce-scatters of sharded stages" in r.stdout
    assert "where each rank's step ends" in r.stdout and "no parameter gathers" not in r.stdout
    r = simulate("--measured", str(tmp_path / "without.json"))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if "record no parameter gathers" in line]
    assert len(lines) == 1 and "parameter gathers of sharded stages" not in r.stdout
    old = _measured(gathers=False).model_dump(mode="json")  # a trace written before gathers were recorded
    del old["zbsearch"]["gathers"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    from zbsearch.formats.trace import load_trace

    assert load_trace(tmp_path / "old.json").zbsearch.gathers is None
    r = simulate("--measured", str(tmp_path / "old.json"))
    assert r.returncode == 0 and "record no parameter gathers" in r.stdout
