"""The Gantt chart's reduction lane: each rank's gradient reductions where the profile ends the
iteration with them, drawn from the simulator's timeline."""

from __future__ import annotations

import pytest

import zbsearch as zb
from zbsearch.reductions import with_reductions
from zbsearch.render.figure import write_figure
from zbsearch.render.gantt import schedule_panel


def _sched(reduce: bool) -> zb.Schedule:
    prof = zb.resolve_profile("1.5b-m24")
    if reduce:
        prof = with_reductions(prof, 16, 25.0, [4e8] * prof.num_stages, t_opt=[2.0] * prof.num_stages)
    return zb.build_classic("zb-h1", prof, 12)


def test_the_panel_holds_each_ranks_reductions_and_the_iteration(tmp_path):
    sched = _sched(True)
    tl = zb.timeline(sched)
    panel = schedule_panel(sched)
    origin = min(row[0] for row in tl.start)
    assert len(panel.reductions) == sched.num_ranks
    for r in range(sched.num_ranks):
        got = [(s, a + origin, b + origin) for s, a, b in panel.reductions[r]]
        assert [s for s, _, _ in got] == [s for s, _, _ in tl.reductions[r]]
        assert [x for _, a, b in got for x in (a, b)] == pytest.approx([x for _, a, b in tl.reductions[r] for x in (a, b)])
        # one reduction per stage of the rank, none before that stage's last backward has ended
        assert sorted(s for s, _, _ in panel.reductions[r]) == sorted(
            s for s in range(sched.num_stages) if sched.stage_to_rank[s] == r)
        for s, a, _ in got:
            last = max(e for x, e in zip(tl.actions[r], tl.end[r]) if x.stage == s and x.op.value in ("W", "BW"))
            assert a >= last - 1e-9
    assert panel.iteration == pytest.approx(tl.period) and panel.iteration > panel.span
    assert panel.end >= max(b for lane in panel.reductions for _, _, b in lane)
    assert f"iteration {panel.iteration:.4g} ms" in panel.title()
    write_figure([panel], tmp_path / "lane.png")
    assert (tmp_path / "lane.png").stat().st_size > 0


def test_no_lane_without_reductions():
    panel = schedule_panel(_sched(False))
    assert panel.reductions == [] and panel.iteration is None and "iteration" not in panel.title()
