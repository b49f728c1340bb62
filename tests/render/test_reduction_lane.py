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


def _sharded(kind: str = "zb-h1") -> zb.Schedule:
    prof = zb.resolve_profile("1.5b-m24")
    return zb.build_classic(kind, with_reductions(prof, 8, 25.0, [4e8] * prof.num_stages, sharded=True), 8)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-v"])
def test_the_lane_shows_each_ranks_gathers_apart_from_its_reductions(tmp_path, kind):
    from zbsearch.render import render_text, write_chart

    sched = _sharded(kind)
    tl = zb.timeline(sched)
    panel = schedule_panel(sched)
    # time 0 is the earliest step start: rank 0 gathers its first stage before its first pass
    origin = min(tl.begin)
    assert origin == 0.0 and panel.rows[0][0].start == pytest.approx(tl.start[0][0])
    for r in range(sched.num_ranks):
        assert [s for s, _, _ in panel.gathers[r]] == [s for s, _, _ in tl.gathers[r]]
        assert [x + origin for _, a, b in panel.gathers[r] for x in (a, b)] == pytest.approx(
            [x for _, a, b in tl.gathers[r] for x in (a, b)])
        # one gather per stage of the rank, each ended by its stage's first pass
        assert sorted(s for s, _, _ in panel.gathers[r]) == [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == r]
        for s, _, b in panel.gathers[r]:
            first = min(bar.start for bar in panel.rows[r] if bar.action.stage == s)
            assert b <= first + 1e-9
        kinds = [k for k, _, _, _ in panel.lane(r)]
        assert kinds == sorted(kinds, key=lambda k: k != "gather")  # gathers first, then reductions
    text = render_text([panel], width=100)
    lanes = [line for line in text.splitlines() if line.startswith("   :")]
    assert len(lanes) == sched.num_ranks
    assert all(line.index("~") < line.index("=") for line in lanes)
    assert "~ parameter gather (sharded)" in text and "= gradient reduction" in text
    write_chart([panel], tmp_path / "lane.html")
    html = (tmp_path / "lane.html").read_text()
    assert html.count("parameter gather (sharded) of stage") == sum(map(len, tl.gathers))
    assert html.count("gradient reduction (data parallel) of stage") == sum(map(len, tl.reductions))
    write_chart([panel], tmp_path / "lane.png")
    assert (tmp_path / "lane.png").stat().st_size > 0


def test_no_gathers_drawn_where_no_stage_is_sharded():
    from zbsearch.render import render_text

    panel = schedule_panel(_sched(True))
    assert not any(panel.gathers) and panel.has_lane
    text = render_text([panel], width=100)
    assert "~" not in text and "=" in text
    assert not schedule_panel(_sched(False)).has_lane
