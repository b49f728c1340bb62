"""The iteration in the command line: --dp, --dp-bandwidth and --grad-bytes end each rank's
iteration with its stages' gradient reductions, and compare says how much of each schedule's
gain over 1F1B the iteration keeps.

The reductions are checked against a ring all-reduce worked out here from the bytes and the
bandwidth, on the simulator's timeline of the passes alone."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.actions import Op

DP = ["--dp", "8", "--dp-bandwidth", "25", "--grad-bytes", "3GB"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*cli_command(), *args], capture_output=True, text=True)


def _iteration_by_hand(kind: str, profile: str, m: int, replicas: int, gbs: float, total_bytes: float,
                       sharded: bool = False) -> float:
    """The longest rank's iteration: each rank's stages reduce one after another as their last
    backward ends (a ring all-reduce, 2(N-1)/N of the bytes through each rank), after its passes.
    ``sharded`` (one stage per rank): a reduce-scatter, half the bytes, and before the passes each
    rank gathers its stage's parameters, a ring all-gather of as many bytes (g): rank 0's first
    pass waits g, which every pass after it waits too; every other rank's first input comes after
    its gather has ended, and its step starts g before its first pass. Every rank's iteration
    is its iteration without the gather plus g."""
    sched = zb.build_classic(kind, zb.resolve_profile(profile), m)
    tl = zb.timeline(sched)
    per_stage = total_bytes / sched.num_stages
    t_red = (1 if sharded else 2) * (replicas - 1) / replicas * per_stage / (gbs * 1e9) * 1e3
    gather = t_red / 2 if not sharded else t_red
    if sharded:
        assert sched.num_stages == sched.num_ranks
    else:
        gather = 0.0
    out = []
    for r, row in enumerate(sched.rank_actions):
        ends = tl.end[r]
        last = {}
        for a, e in zip(row, ends):
            if a.op in (Op.W, Op.BW):
                last[a.stage] = e
        free = 0.0
        for e in sorted(last.values()):
            free = max(free, e) + t_red
        out.append(max(free, max(ends)) - min(tl.start[r]) + gather)
    return max(out)


def test_compare_rows_end_with_the_reductions_worked_out_by_hand():
    r = _run("compare", "-p", "1.5b-m24", "-m", "24", "-t", "2", "--json", *DP)
    assert r.returncode == 0, r.stderr
    rows = {x["kind"]: x for x in json.loads(r.stdout) if "span" in x}
    for kind in ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b"):
        assert rows[kind]["iteration"] == pytest.approx(_iteration_by_hand(kind, "1.5b-m24", 24, 8, 25, 3e9), rel=1e-9)
    base = rows["1f1b"]
    for kind, row in rows.items():
        assert row["iteration"] >= row["span"] - 1e-9
        if kind != "1f1b" and row["span"] < base["span"] - 1e-6:
            kept = (base["iteration"] - row["iteration"]) / (base["span"] - row["span"])
            assert row["gain_kept"] == pytest.approx(kept)
    # a V finishes its stages' backwards before the rank's last pass: it hides some of its reductions
    assert rows["zb-v"]["iteration"] - rows["zb-v"]["span"] < base["iteration"] - base["span"] - 1e-6


def test_sharded_stages_gather_before_their_passes_in_compare_and_the_verdict():
    r = _run("compare", "-p", "1.5b-m24", "-m", "24", "-t", "1", "--json", *DP, "--shard")
    assert r.returncode == 0, r.stderr
    rows = {x["kind"]: x for x in json.loads(r.stdout) if "span" in x}
    for kind in ("1f1b", "zb-h1", "zb-h2"):
        want = _iteration_by_hand(kind, "1.5b-m24", 24, 8, 25, 3e9, sharded=True)
        assert rows[kind]["iteration"] == pytest.approx(want, rel=1e-9)
        assert rows[kind]["iteration"] > _iteration_by_hand(kind, "1.5b-m24", 24, 8, 25, 3e9) - 20  # not the all-reduce's
    # the solver's verdict prices the best classic schedule's iteration with the gathers too
    r = _run("solve", "-p", "1.5b-m24", "-m", "8", "-t", "2", *DP, "--shard")
    assert r.returncode == 0, r.stderr
    words = " ".join(r.stdout.split())
    classic = re.search(r"classic schedule within the limit, ([\w-]+) \(iteration ([\d.]+) ms\)", words)
    itself = re.search(r"the best schedule found is the classic ([\w-]+)", words)
    assert classic is not None or itself is not None, words
    kind, value = (classic.group(1), classic.group(2)) if classic is not None else (
        itself.group(1), re.search(r"iteration ([\d.]+) ms", words).group(1))  # type: ignore[union-attr]
    assert float(value) == pytest.approx(_iteration_by_hand(kind, "1.5b-m24", 8, 8, 25, 3e9, sharded=True), rel=1e-5)
    bad = _run("compare", "-p", "1.5b-m24", "-m", "8", "--shard")
    assert bad.returncode != 0 and "--shard needs --dp" in bad.stderr and "Traceback" not in bad.stderr


def test_compare_without_reductions_has_no_iteration_column():
    r = _run("compare", "-p", "1.5b-m24", "-m", "24", "-t", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert not any("iteration" in x or "gain_kept" in x for x in json.loads(r.stdout))


def test_schedule_and_simulate_print_the_iteration(tmp_path):
    path = tmp_path / "zb-h1.json"
    r = _run("schedule", "zb-h1", "-p", "1.5b-m24", "-m", "24", "-o", str(path), *DP)
    assert r.returncode == 0, r.stderr
    want = _iteration_by_hand("zb-h1", "1.5b-m24", 24, 8, 25, 3e9)
    saved = zb.load_schedule(path)
    assert saved.profile.data_parallel.replicas == 8
    assert max(saved.predicted.iteration) == pytest.approx(want, rel=1e-9)
    assert f"iteration {want:.6g}"[:14] in r.stdout.replace("\n", " ")
    plain = tmp_path / "plain.json"
    assert _run("schedule", "zb-h1", "-p", "1.5b-m24", "-m", "24", "-o", str(plain)).returncode == 0
    r = _run("simulate", str(plain), *DP)
    assert r.returncode == 0, r.stderr
    assert "iteration" in r.stdout and "across 8 replicas" in r.stdout
    assert "iteration" not in _run("simulate", str(plain)).stdout
