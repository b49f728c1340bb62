"""Gantt rendering: text, PNG/SVG/HTML files, measured-vs-predicted, and one-line errors."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

import zbsearch as zb
from zbsearch.app import cli
from zbsearch.formats.edit import updated
from zbsearch.render import intervals_panel, load_measured, render_text, schedule_panel, with_measured, write_chart

WIDTH = 100


@pytest.fixture(scope="module")
def unit():
    return zb.resolve_profile("unit-p4")


@pytest.fixture(scope="module")
def zb_h1(unit):
    return zb.build_classic("zb-h1", unit, 8)


def _trace(schedule: zb.Schedule, t_b: float = 1.1, t_w: float = 1.4) -> dict:
    """A runtime-like trace of ``schedule``: slower B and W, a comm delay, epoch timestamps."""
    stages = [updated(s, t_b=t_b, t_w=t_w) for s in schedule.profile.stages]
    prof = updated(schedule.profile, stages=stages, t_comm=0.08)
    tl = zb.simulate(schedule.rank_actions, zb.CostModel.from_profile(prof, schedule.stage_to_rank))
    t0 = 1.7e12  # µs since the epoch, as a real trace has
    events = [
        {"name": str(a), "ph": "X", "pid": r, "tid": 0, "ts": t0 + s * 1e3, "dur": (e - s) * 1e3,
         "args": {"stage": a.stage, "op": a.op.value, "mb": a.mb}}
        for r in range(tl.num_ranks) for a, s, e in zip(tl.actions[r], tl.start[r], tl.end[r])
    ]
    events.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}})
    header = {"format": "zbsearch.trace", "version": 1, "schedule_kind": schedule.kind, "num_ranks": schedule.num_ranks}
    return {"traceEvents": events, "displayTimeUnit": "ms", "zbsearch": header}


def _run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["zbsearch", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


# --- text ---------------------------------------------------------------------------------


def test_text_rows_ops_idle_and_legend(zb_h1):
    lines = render_text([schedule_panel(zb_h1)], width=WIDTH).splitlines()
    assert (
        lines[0].startswith("predicted: zb-h1  p=4 m=8") and "bubble rate 0.1111" in lines[0] and "peak memory 4 M_B" in lines[0]
    )
    rows = [line for line in lines if line[:1] == "r"]
    assert [row.split("|")[0].strip() for row in rows] == ["r0", "r1", "r2", "r3"]
    assert all(len(row) == WIDTH for row in rows)
    body = [row.split("|", 1)[1] for row in rows]
    assert all(set("FBW") <= set(b) for b in body)
    assert body[0].startswith("F0") and body[3].startswith(".")  # rank 3 waits for the first forward
    assert "." in body[0].rstrip(".")  # rank 0's warm-up bubble, between its forwards and first B
    assert lines[-1].startswith("F forward") and ". idle" in lines[-1] and "1 column = " in lines[-1]
    assert lines[-2].strip().startswith("0") and lines[-2].endswith("ms")


def test_text_marks_chunks_and_fused_backward(unit):
    zbv = render_text([schedule_panel(zb.build_classic("zb-v", unit, 8))], width=WIDTH)
    assert "(2 chunks/rank)" in zbv and {"f", "b", "w"} <= set(zbv) and "lower case: odd chunk" in zbv
    one_f_one_b = render_text([schedule_panel(zb.build_classic("1f1b", unit, 8))], width=WIDTH)
    assert "X fused B+W" in one_f_one_b and "X0" in one_f_one_b


def test_text_stacks_panels_on_one_time_scale(unit):
    panels = [schedule_panel(zb.build_classic(k, unit, 8)) for k in ("1f1b", "zb-h2")]
    rows = [line.split("|", 1)[1] for line in render_text(panels, width=WIDTH).splitlines() if line.startswith("r0 |")]
    # zb-h2 finishes at 27 ms of 1f1b's 33: its row ends in idle columns, 1f1b's does not.
    assert len(rows) == 2 and not rows[0].endswith(".") and rows[1].endswith("." * 10)


def test_text_big_schedule_stays_within_width():
    sched = zb.build_classic("zb-h1", zb.resolve_profile("28.3b-m256"), 256)
    text = render_text([schedule_panel(sched)], width=120)
    lines = text.splitlines()
    assert sum(line.startswith("r") for line in lines) == 32
    assert all(len(line) <= 120 for line in lines[1:-1])
    assert "#" in text  # steady state: many passes per column


def test_text_elides_middle_ranks():
    rows = [[(f"{r}F0", float(r), r + 1.0)] for r in range(100)]
    lines = render_text([intervals_panel("fake", "predicted", 1, rows)], width=60).splitlines()
    assert any("37 ranks not shown" in line for line in lines)
    assert lines[1].startswith("r0 ") and any(line.startswith("r99 ") for line in lines)


# --- files --------------------------------------------------------------------------------


class _Strict(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def test_png_svg_html_files(zb_h1, unit, tmp_path):
    panels = [schedule_panel(zb_h1), schedule_panel(zb.build_classic("zb-v", unit, 8))]
    png, svg, html = (write_chart(panels, tmp_path / f"chart.{ext}") for ext in ("png", "svg", "html"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert ET.parse(svg).getroot().tag.endswith("svg")
    doc = html.read_text()
    parser = _Strict()
    parser.feed(doc)
    assert {"html", "svg", "rect", "title"} <= set(parser.tags) and "script" not in parser.tags and "link" not in parser.tags
    for fragment in doc.split("<svg ")[1:]:  # each inline chart is well-formed XML
        ET.fromstring("<svg " + fragment.split("</svg>")[0] + "</svg>")
    assert "0W3 (weight grad) on rank 0&#10;" in doc and " ms (1.000 ms)" in doc


def test_measured_vs_predicted(zb_h1, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_trace(zb_h1)))
    measured = load_measured(trace)
    assert measured.num_ranks == 4 and measured.rows[0][0].start == 0.0 and measured.span > schedule_panel(zb_h1).span
    panels, title = with_measured(schedule_panel(zb_h1), trace)
    assert [p.source for p in panels] == ["predicted", "measured"]
    assert title.startswith("zb-h1  p=4 m=8: measured span") and "vs predicted 27 ms (+" in title
    out = write_chart(panels, tmp_path / "cmp.png", title)
    assert out.read_bytes()[:4] == b"\x89PNG"
    text = render_text(panels, width=WIDTH, title=title)
    assert text.splitlines()[0] == title and "measured: zb-h1" in text


def test_cli_show(zb_h1, tmp_path, monkeypatch, capsys):
    path = tmp_path / "zb-h1.json"
    zb.save_schedule(zb_h1, path)
    code, out, _ = _run_cli(monkeypatch, capsys, "show", path, "--width", "80")
    assert code in (0, None) and "r3 |" in out and "\x1b[" not in out
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_trace(zb_h1)))
    code, out, err = _run_cli(monkeypatch, capsys, "show", path, path, "-o", tmp_path / "two.svg")
    assert code in (0, None) and (tmp_path / "two.svg").stat().st_size > 0 and out == ""
    code, out, _ = _run_cli(monkeypatch, capsys, "show", path, "--measured", trace, "-o", tmp_path / "cmp.html", "--text")
    assert code in (0, None) and "measured span" in (tmp_path / "cmp.html").read_text() and "measured: zb-h1" in out


# --- errors -------------------------------------------------------------------------------


def _bad_traces(schedule: zb.Schedule) -> dict[str, tuple[object, str]]:
    good = _trace(schedule)
    wrong_rank = json.loads(json.dumps(good))
    wrong_rank["traceEvents"][0]["pid"] = 9
    bad_op = json.loads(json.dumps(good))
    bad_op["traceEvents"][0]["args"]["op"] = "Q"
    other = _trace(zb.build_classic("1f1b", schedule.profile, 8))
    return {
        "no header": ({"traceEvents": []}, "not a zbsearch trace"),
        "version": ({**good, "zbsearch": {**good["zbsearch"], "version": 7}}, "version 7 is not supported"),
        "rank": (wrong_rank, "is on rank 9 but the trace has 4 ranks"),
        "op": (bad_op, "traceEvents[0].args.op: Input should be 'F', 'B', 'W', 'BW', 'R' or 'RS'"),
        "empty": ({**good, "traceEvents": []}, "holds no actions"),
        "other schedule": (other, "not a trace of this schedule"),
    }


def test_bad_traces_give_one_line_errors(zb_h1, tmp_path):
    predicted = schedule_panel(zb_h1)
    for name, (data, message) in _bad_traces(zb_h1).items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(zb.ZbError, match=re.escape(message)) as info:
            with_measured(predicted, path)
        assert "\n" not in str(info.value), name
    (tmp_path / "broken.json").write_text('{"traceEvents": [')
    with pytest.raises(zb.ZbError, match="not valid JSON"):
        load_measured(tmp_path / "broken.json")
    with pytest.raises(zb.ZbError, match="no such file"):
        load_measured(tmp_path / "missing.json")


def test_bad_chart_path(zb_h1, tmp_path):
    panels = [schedule_panel(zb_h1)]
    with pytest.raises(zb.ZbError, match=r"use one of \.png, \.svg, \.html"):
        write_chart(panels, tmp_path / "chart.jpg")
    with pytest.raises(zb.ZbError, match="does not exist"):
        write_chart(panels, tmp_path / "no" / "chart.png")


def test_cli_errors_are_one_line(zb_h1, tmp_path, monkeypatch, capsys):
    path = tmp_path / "zb-h1.json"
    zb.save_schedule(zb_h1, path)
    (tmp_path / "bad.json").write_text("[1, 2")
    cases = [
        (("show", tmp_path / "missing.json"), "no such file"),
        (("show", path, "-o", tmp_path / "chart.gif"), "cannot tell the chart format"),
        (("show", path, "--measured", tmp_path / "bad.json"), "not valid JSON"),
        (("show", path, path, "--measured", tmp_path / "bad.json"), "give exactly one SCHEDULE"),
    ]
    for args, message in cases:
        code, _, err = _run_cli(monkeypatch, capsys, *args)
        assert code == 1 and message in err and err.count("\n") == 1, (args, err)
