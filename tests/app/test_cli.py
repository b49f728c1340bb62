"""The command line: happy paths and one-line errors with non-zero exit (run as a user would)."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import cli_command


def zbsearch(*args, cwd=None):
    return subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_schedule_simulate_validate_round_trip(tmp_path):
    out = tmp_path / "h1.json"
    r = zbsearch("schedule", "zb-h1", "--profile", "1.5b-m24", "-m", "24", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "bubble rate 0.15" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "zbsearch.schedule" and doc["kind"] == "zb-h1" and len(doc["actions"]) == 8
    r = zbsearch("simulate", out)
    assert r.returncode == 0 and "peak memory" in r.stdout
    r = zbsearch("validate", out)
    assert r.returncode == 0 and r.stdout.startswith("valid")
    r = zbsearch("validate", out, "--mem-limit", "0.5p")
    assert r.returncode == 1 and "over its limit" in r.stderr


def test_compare_json_lists_every_kind():
    r = zbsearch("compare", "--profile", "1.5b-m24", "-m", "24", "--mem-limit", "1p", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["kind"]: row for row in json.loads(r.stdout)}
    assert {"1f1b", "zb-h1", "zb-h2", "zb-v", "gpipe", "interleaved-1f1b"} <= set(rows)
    assert rows["zb-h2"]["fits"] is False and rows["zb-h1"]["fits"] is True


@pytest.mark.parametrize(
    "args, words",
    [
        (["schedule", "zb-h9", "-p", "1.5b-m24", "-m", "8"], "unknown schedule kind"),
        (["schedule", "1f1b", "-p", "missing.json", "-m", "8"], "no such file"),
        (["schedule", "interleaved-1f1b", "-p", "1.5b-m24", "-m", "9"], "multiple of p"),
        (["simulate", "nothere.json"], "no such file"),
        (["compare", "-p", "1.5b-m24", "-m", "8", "--mem-limit", "lots"], "cannot read memory limit"),
        (["compare", "-p", "1.5b-m24", "-m", "8", "--mem-limit", "40GiB"], "byte budget"),
    ],
)
def test_user_errors_are_one_line(args, words):
    r = zbsearch(*args)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr


def test_malformed_schedule_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "zbsearch.schedule", "version": 1, ')
    r = zbsearch("validate", bad)
    assert r.returncode == 1 and "not valid JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("over", [5e-13, 5e-12])  # inside, then outside the float-noise tolerance
def test_compare_and_validate_agree_at_the_tolerance_edge(tmp_path, over):
    """``compare``'s "fits" and ``validate`` judge a peak just over the limit the same way."""
    import zbsearch as zb

    prof = zb.Profile(name="tiny-mem", memory_unit="activations", stages=[
        zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1e-4, m_b=-6e-5, m_w=-4e-5) for _ in range(2)])
    zb.save_profile(prof, tmp_path / "p.json")
    sched = zb.build_classic("1f1b", prof, 4)
    zb.save_schedule(sched, tmp_path / "s.json")
    peak, unit = max(sched.predicted.peak_memory), 2 * 1e-4  # 1p on rank 0 is p * M_B
    limit = f"{(peak - over) / unit!r}p"
    r = zbsearch("compare", "--profile", tmp_path / "p.json", "-m", "4", "--mem-limit", limit, "--json")
    assert r.returncode == 0, r.stderr
    fits = {row["kind"]: row for row in json.loads(r.stdout)}["1f1b"]["fits"]
    valid = zbsearch("validate", tmp_path / "s.json", "--mem-limit", limit)
    assert fits == (valid.returncode == 0) == (over < 1e-12), valid.stderr


def test_placement_and_chunks_mean_one_thing_each(tmp_path):
    """solve and frontier take --placement one|v; schedule and compare take --chunks (interleaved
    chunks per rank). The earlier spellings (-v, --chunks 1|2 on solve) still work, with a note."""
    v, old = tmp_path / "v.json", tmp_path / "old.json"
    r = zbsearch("solve", "-p", "unit-p4", "-m", "8", "--placement", "v", "--no-milp", "-o", v)
    assert r.returncode == 0 and r.stderr.count("note:") == 0, r.stderr
    r = zbsearch("solve", "-p", "unit-p4", "-m", "8", "--chunks", "2", "--no-milp", "-o", old)
    assert r.returncode == 0 and "--chunks/-v 2 is now --placement v" in r.stderr, r.stderr
    a, b = json.loads(v.read_text()), json.loads(old.read_text())
    assert a["stage_to_rank"] == b["stage_to_rank"] == [0, 1, 2, 3, 3, 2, 1, 0] and a["actions"] == b["actions"]
    r = zbsearch("solve", "-p", "unit-p4", "-m", "8", "--placement", "x", "--no-milp")
    assert r.returncode == 1 and "use one" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    three, dash_v = tmp_path / "c3.json", tmp_path / "v3.json"
    assert zbsearch("schedule", "interleaved-1f1b", "-p", "unit-p4", "-m", "8", "--chunks", "3", "-o", three).returncode == 0
    r = zbsearch("schedule", "interleaved-1f1b", "-p", "unit-p4", "-m", "8", "-v", "3", "-o", dash_v)
    assert r.returncode == 0 and "-v is now --chunks" in r.stderr
    assert json.loads(three.read_text())["stage_to_rank"] == json.loads(dash_v.read_text())["stage_to_rank"] == [0, 1, 2, 3] * 3
    r = zbsearch("compare", "-p", "unit-p4", "-m", "8", "--json")  # default: interleaved with 2 chunks, as schedule
    rows = {row["kind"]: row for row in json.loads(r.stdout)}
    built = zbsearch("schedule", "interleaved-1f1b", "-p", "unit-p4", "-m", "8").stdout
    assert f"span {rows['interleaved-1f1b']['span']:.6g} ms" in built


@pytest.mark.parametrize("columns", ["40", "80", "200"])
def test_tables_never_cut_a_number(tmp_path, columns):
    import os

    import zbsearch as zb

    sched = zb.build_classic("zb-h1", zb.load_profile("1.5b-m24"), 24)
    path = tmp_path / "s.json"
    zb.save_schedule(sched, path)
    r = subprocess.run([*cli_command(), "simulate", str(path)], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": columns})
    assert r.returncode == 0, r.stderr
    tl = zb.timeline(sched)
    for rank in range(sched.num_ranks):
        row = next(line for line in r.stdout.splitlines() if line.startswith(f"│ {rank:>4} │"))
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1] == f"{tl.span[rank]:.6g}" and cells[4] == f"{tl.peak_memory[rank]:.6g}", row
    assert "…" not in r.stdout


def test_compare_on_pieces_of_a_v_lists_the_kinds_that_do_not_apply(tmp_path):
    doc = json.loads((Path(__file__).resolve().parents[2] / "zbsearch/profiles/unit-p4.json").read_text())
    doc.update(placement=[0, 1, 1, 0], name="pieces")
    (tmp_path / "pieces.json").write_text(json.dumps(doc))
    r = zbsearch("compare", "-p", tmp_path / "pieces.json", "-m", "8")
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("│")}
    assert "n/a" in rows["1f1b"] and "n/a" not in rows["zb-v"]
    note = next(line for line in r.stdout.splitlines() if line.startswith("n/a for "))
    assert "1f1b" in note and "zb-v" not in note.split(":")[0] and "measured for 2 ranks" in note
