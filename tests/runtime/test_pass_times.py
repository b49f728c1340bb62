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
def test_emulated_fused_backward_sleeps_t_bw_and_split_sleeps_t_b_then_t_w(slept, first):
    stage = EmulatedStage(1.0, 2.0, 3.0, t_bw=4.0)
    x = torch.zeros(16, requires_grad=not first)
    grad = [torch.ones(16)]
    backward_full(forward_pass(stage, (x,), split=False), grad)
    assert slept == [0.0, 1.0, 2.0, 2.0]  # Weight's F, Act's F, Act's B, then t_bw - t_b
    slept.clear()
    fp = forward_pass(stage, (x,))
    backward_input(fp, grad)
    backward_weight(fp)
    assert slept == [0.0, 1.0, 2.0, 3.0]
    slept.clear()
    backward_full(forward_pass(EmulatedStage(1.0, 2.0, 3.0), (x,), split=False), grad)
    assert slept == [0.0, 1.0, 2.0, 3.0]  # no t_bw: the split's cost


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
