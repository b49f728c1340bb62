"""bench/report.py: every topic renders from its saved results, and the newest report of each
topic is what its results render to (a report never drifts from the numbers it shows)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from bench.report import NOTES, RESULTS, TOPICS, _round, render, reports_by_name, source


@pytest.mark.parametrize("topic", sorted(TOPICS))
def test_every_topic_renders_from_its_saved_results(topic):
    text, machine, date = render(topic, [source(str(RESULTS / f)) for f in TOPICS[topic].files])
    assert text.startswith(f"# {TOPICS[topic].title}\n")
    assert "| machine | " in text and "| load average | " in text and "| data | " in text
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|undated", date)
    assert machine.tag


def _in_git() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "rev-parse", "--git-dir"], cwd=RESULTS, capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_git(), reason="the reports name the commits that saved their results")
@pytest.mark.parametrize("topic", sorted(TOPICS))
def test_the_newest_report_is_what_its_results_render_to(topic):
    reports = reports_by_name().get(topic)
    if not reports:
        pytest.skip(f"no report of {topic} yet")
    newest = reports[0].path
    generated = newest.read_text().split(NOTES, 1)[0].rstrip()
    if "replaced since by a later run" in generated:
        pytest.skip("rendered from results an earlier commit saved")
    text, _, _ = render(topic, [source(str(RESULTS / f)) for f in TOPICS[topic].files])
    assert generated == text.rstrip(), f"{newest.name} differs from `python bench/report.py {topic} -o -`"


def test_a_results_file_the_checkout_has_not_committed_says_so(tmp_path):
    doc = json.loads((RESULTS / "classic.json").read_text())
    doc["machine"] = {**doc["machine"], "commit": "abc123", "date": "2030-01-02T03:04:05+00:00"}
    path = tmp_path / "classic.json"
    path.write_text(json.dumps(doc))
    text, _, date = render("classic", [source(str(path))])
    assert date == "2030-01-02"
    assert "| commit measured (classic.json) | `abc123` |" in text
    assert f"| data | `{path}` (not committed) |" in text


def test_numbers_round_half_up_as_written():
    assert _round(0.00045, 4) == "0.0005"
    assert _round(0.14215, 4) == "0.1422"
    assert _round(-0.0, 4) == "0.0000"
    assert _round(59.92, 0) == "60"
