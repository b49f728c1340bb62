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
