"""Emulated stages charge a fused backward t_bw, and the measured-vs-predicted report reads the
runtime's own trace: counts, means and predictions per rank and pass type."""

from __future__ import annotations

import json

import pytest
import torch

import zbsearch as zb
from tests.helpers import make_profile, run_cli
from zbsearch.actions import Op
from zbsearch.formats.edit import updated
from zbsearch.formats.trace import save_trace
from zbsearch.pass_times import compare_pass_times
from zbsearch.runtime import PipelineRuntime, backward_full, backward_input, backward_weight, emulation, forward_pass
from zbsearch.runtime.emulation import EmulatedStage, emulated_loss, emulated_stages


@pytest.fixture
def slept(monkeypatch):
    """The sleeps emulated passes ask for, in order (nothing really sleeps)."""
    asked: list[float] = []
    monkeypatch.setattr(emulation, "_sleep", asked.append)
    return asked


@pytest.mark.parametrize("first", [False, True])
def test_emulated_fused_backward_sleeps_t_ff_then_t_bw_and_split_sleeps_t_f_t_b_then_t_w(slept, first):
    stage = EmulatedStage(1.0, 2.0, 3.0, t_bw=4.0, t_ff=0.5)
    x = torch.zeros(16, requires_grad=not first)
    grad = [torch.ones(16)]
    backward_full(forward_pass(stage, (x,), split=False), grad)
    assert slept == [0.0, 0.5, 2.0, 2.0]  # Weight's F, Act's F (t_ff), Act's B, then t_bw - t_b
    slept.clear()
    fp = forward_pass(stage, (x,))
    _, w = backward_input(fp, grad)
    backward_weight(w)
    assert slept == [0.0, 1.0, 2.0, 3.0]
    slept.clear()
    backward_full(forward_pass(EmulatedStage(1.0, 2.0, 3.0), (x,), split=False), grad)
    assert slept == [0.0, 1.0, 2.0, 3.0]  # no t_bw, no t_ff: the split's costs


@pytest.mark.usefixtures("one_rank")
def test_the_runtime_sleeps_t_ff_for_the_forwards_of_fused_microbatches_only(slept):
    """A schedule that fuses microbatches 0 and 2 and splits 1 and 3: each action sleeps what
    ``CostModel.durations`` gives it (ms from the profile, slept in seconds)."""
    prof = make_profile(1, t_f=1.0, t_b=1.5, t_w=0.75)
    prof = updated(prof, stages=[updated(prof.stages[0], t_bw=2.0, t_ff=0.625)])
    A, F, B, W, BW = zb.Action, Op.F, Op.B, Op.W, Op.BW
    rows = [[A(0, F, 0), A(0, BW, 0), A(0, F, 1), A(0, B, 1), A(0, W, 1),
             A(0, F, 2), A(0, BW, 2), A(0, F, 3), A(0, B, 3), A(0, W, 3)]]
    sched = zb.Schedule.build("mixed", prof, 4, [0], rows)
    runtime = PipelineRuntime(sched, dict(enumerate(emulated_stages(prof, [0], bytes_per_unit=64))), emulated_loss)
    runtime.step(torch.randn(8, 16), torch.randn(8, 16))
    # per action: F sleeps Weight's 0 then Act's forward, BW Act's B then t_bw - t_b
    want = {F: [0.0, 1.0], B: [1.5], W: [0.75], BW: [1.5, 0.5]}
    expected = [x / 1e3 for a in rows[0] for x in ([0.0, 0.625] if a.op is F and a.mb in (0, 2) else want[a.op])]
    assert slept == pytest.approx(expected)
    (durations,) = zb.CostModel.from_profile(prof, [0]).durations(rows)
    assert [d for a, d in zip(rows[0], durations) if a.op is F] == [0.625, 1.0, 0.625, 1.0]


def _profile() -> zb.Profile:
    prof = make_profile(1, t_f=1.0, t_b=1.5, t_w=1.0)
    return updated(prof, stages=[updated(prof.stages[0], t_bw=2.0)])


def _traces(sched: zb.Schedule, steps: int) -> list[zb.formats.trace.Trace]:
    stages = emulated_stages(sched.profile, sched.stage_to_rank, bytes_per_unit=64, time_scale=0.01)
    runtime = PipelineRuntime(sched, dict(enumerate(stages)), emulated_loss)
    m = sched.num_microbatches
    out = []
    for _ in range(steps):
        runtime.step(torch.randn(2 * m, 16), torch.randn(2 * m, 16))
        out.append(runtime.trace())
    return out


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-v"])
def test_pass_report_on_an_emulated_trace(kind):
    sched = zb.build_classic(kind, _profile(), 4)
    traces = _traces(sched, 2)
    cost = zb.CostModel.from_profile(sched.profile, sched.stage_to_rank)
    rows = compare_pass_times(sched, traces)
    want_ops = sorted({a.op for a in sched.rank_actions[0]}, key=list(Op).index)
    assert [(x.rank, x.op) for x in rows] == [(0, op) for op in want_ops]
    for x in rows:
        mine = [e for t in traces for e in t.traceEvents if e.args.op is x.op]
        assert x.count == len(mine) == 2 * sum(a.op is x.op for a in sched.rank_actions[0])
        assert x.measured_ms == pytest.approx(sum(e.dur for e in mine) / 1e3 / len(mine))
        assert x.predicted_ms == pytest.approx(sum(cost.time(e.args.stage, x.op) for e in mine) / len(mine))
    if kind == "1f1b":
        assert rows[-1].op is Op.BW and rows[-1].predicted_ms == pytest.approx(2.0)


@pytest.mark.usefixtures("one_rank")
def test_pass_report_rejects_a_trace_of_another_schedule():
    ours = zb.build_classic("1f1b", _profile(), 4)
    other = zb.build_classic("zb-h1", _profile(), 4)
    with pytest.raises(zb.ZbError, match="not of this schedule: rank 0 ran"):
        compare_pass_times(ours, _traces(other, 1))
    with pytest.raises(zb.ZbError, match="no trace"):
        compare_pass_times(ours, [])


@pytest.mark.usefixtures("one_rank")
def test_simulate_measured_prints_the_pass_table(tmp_path):
    sched = zb.build_classic("1f1b", _profile(), 4)
    zb.save_schedule(sched, tmp_path / "s.json")
    paths = [save_trace(t, tmp_path / f"t{i}.json") for i, t in enumerate(_traces(sched, 2))]
    res = run_cli("simulate", tmp_path / "s.json", "--measured", paths[0], "--measured", paths[1])
    assert res.returncode == 0, res.stderr
    assert "mean over 2 measured step(s)" in res.stdout and "measured / predicted" in res.stdout
    as_json = run_cli("simulate", tmp_path / "s.json", "--measured", paths[0], "--json")
    rows = json.loads(as_json.stdout)["passes"]
    assert [(r["op"], r["count"], r["predicted_ms"]) for r in rows] == [("F", 4, 1.0), ("BW", 4, 2.0)]
    assert "idle time per step" in res.stdout
    (w,) = json.loads(as_json.stdout)["waits"]  # one rank: its idle time split three ways
    assert w["rank"] == 0 and w["idle_ms"] == pytest.approx(w["dependency_ms"] + w["link_ms"] + w["local_ms"])
    assert w["link_ms"] == 0  # nothing comes from another rank
    bad = run_cli("simulate", tmp_path / "s.json", "--measured", tmp_path / "missing.json")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_an_emulated_pass_slows_by_the_profiles_factor_while_a_reduction_is_in_flight(monkeypatch):
    """On a fake clock: a 20 ms pass of a stage whose reduction slows passes 2x, beside a
    reduction in flight for its first 10 ms, does 5 ms of its work then and ends at 25 ms; the
    same pass with nothing in flight ends at 20 ms."""
    import time

    from zbsearch.runtime import data_parallel

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(emulation, "_lag", 0.0)
    monkeypatch.setattr(data_parallel, "_IN_FLIGHT", [])
    prof = make_profile(2, t_f=20.0, t_b=1.0, t_w=1.0)
    prof = prof.model_copy(update={"stages": [st.model_copy(update={"reduce_slowdown": f}) for st, f in
                                              zip(prof.stages, (2.0, 3.0))]})
    stage = emulated_stages(prof, [0, 1])[0]
    data_parallel.note_in_flight(0, lambda: now[0] >= 0.010 - 1e-12)
    stage(torch.zeros(16))
    assert now[0] == pytest.approx(0.025)
    now[0] = 1.0
    stage(torch.zeros(16))
    assert now[0] == pytest.approx(1.020)  # nothing in flight: its own speed
    data_parallel.note_in_flight(1, lambda: now[0] >= 2.006 - 1e-12)  # the other stage's reduction: its factor, 3
    now[0] = 2.0
    stage(torch.zeros(16))
    assert now[0] == pytest.approx(2.0 + 0.006 + 0.018)
    plain = emulated_stages(make_profile(2, t_f=20.0, t_b=1.0, t_w=1.0), [0, 1])[0]
    assert plain.slowed is None  # no factor: the plain sleep, never sliced
