"""What a solve claims, and for which schedules: its bound names the class it covers, a status
says when a part of the solve was cut, and recomputation the profile offers but the solve did
not search is named in the verdict.

The instance is small enough (3 stages, a few microbatches) for the exact model to choose the
recomputation together with the order; the schedules it claims are checked by the validator
and the simulator, not by the solver."""

from __future__ import annotations

import json
import subprocess

import pytest

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.solver import explain, smallest_feasible_limit, solve, status_text, unsearched
from zbsearch.solver.verdict import CLOSED

# 3 stages, full recomputation offered (t_r, m_fc)
TINY = {"format": "zbsearch.profile", "version": 1, "name": "tiny-r4", "time_unit": "ms", "memory_unit": "activations",
        "stages": [{"t_f": 1.1, "t_b": 1.45, "t_w": 0.5, "m_f": 1.0, "m_b": -0.625, "m_w": -0.375, "t_r": 1.05, "m_fc": 0.125},
                   {"t_f": 0.85, "t_b": 1.05, "t_w": 0.95, "m_f": 1.0, "m_b": -0.75, "m_w": -0.25, "t_r": 0.9, "m_fc": 0.125},
                   {"t_f": 0.85, "t_b": 0.85, "t_w": 0.75, "m_f": 1.0, "m_b": -0.75, "m_w": -0.25, "t_r": 0.9,
                    "m_fc": 0.0625}],
        "t_comm": 0.1, "memory_capacity": None}


@pytest.fixture(scope="module")
def tiny() -> zb.Profile:
    return zb.Profile.model_validate(TINY)


def _checked(res) -> float:
    """The schedule's span as the validator and the simulator see it."""
    zb.validate(res.schedule)
    s = res.schedule
    span = zb.simulate(s.rank_actions, zb.CostModel.from_profile(s.profile, s.stage_to_rank)).span
    span = max(span) if isinstance(span, list) else span
    assert span == pytest.approx(res.info.value, rel=1e-9)
    return span


def test_the_tiny_instance_is_proven_optimal_with_its_choice_of_recomputation(tiny):
    res = solve(tiny, 4, "0.5p", recompute="auto", time_limit=2)
    assert res.info.status == "optimal" and res.info.gap <= CLOSED
    assert res.info.bound_covers == "any-recompute"
    assert _checked(res) == pytest.approx(16.05)
    assert res.info.recomputed > 0  # at half of 1F1B's memory only recomputation fits
    assert "no schedule with or without recomputation within the limit is shorter" in status_text(res.info)


def test_optimal_without_recomputation_names_that_class_and_what_it_leaves_out(tiny):
    cost = zb.CostModel.from_profile(tiny, [0, 1, 2])
    limit = [1.25 * x for x in smallest_feasible_limit(cost, 3)]
    plain = solve(tiny, 3, limit, time_limit=2)
    auto = solve(tiny, 3, limit, recompute="auto", time_limit=2)
    assert plain.info.status == "optimal" and plain.info.bound_covers == "no-recompute"
    # a valid schedule that recomputes beats the bound: it never covered such schedules
    assert _checked(auto) < plain.info.lower_bound * (1 - 1e-3)
    assert auto.info.recomputed > 0
    assert "no schedule without recomputation within the limit is shorter" in status_text(plain.info)
    note = [line for line in explain(plain.schedule, plain.info) if "not searched" in line]
    assert len(note) == 1 and "--recompute auto" in note[0] and "full (R)" in note[0]
    # searched, nothing is left out; a profile without recomputation has nothing to leave out
    assert unsearched(cost, "auto") is None
    bare = zb.Profile.model_validate({**TINY, "stages": [{k: v for k, v in s.items() if k not in ("t_r", "m_fc")}
                                                         for s in TINY["stages"]]})
    assert unsearched(zb.CostModel.from_profile(bare, [0, 1, 2]), "none") is None


def test_a_solve_cut_by_its_time_limit_says_so(tiny):
    prof = zb.resolve_profile("1.5b-m24")
    res = solve(prof, 24, "1p", recompute="auto", time_limit=0.05)
    assert res.info.gap > CLOSED and res.info.status == "time_limit"
    assert "stopped at its share of the time limit" in status_text(res.info)
    zb.validate(res.schedule)


def test_bound_covers_follows_the_recomputation_searched(tiny):
    res = solve(tiny, 4, "1p", time_limit=0.5)
    doc = json.loads(res.schedule.model_dump_json())
    assert doc["solver"]["bound_covers"] == "no-recompute"
    del doc["solver"]["bound_covers"]  # a file from before the field: filled from recompute
    assert zb.Schedule.model_validate(doc).solver.bound_covers == "no-recompute"
    doc["solver"]["bound_covers"] = "any-recompute"
    with pytest.raises(ValueError, match="does not match recompute"):
        zb.Schedule.model_validate(doc)


def test_solve_prints_the_class_its_bound_covers(tmp_path, tiny):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    out = subprocess.run([*cli_command(), "solve", "-p", str(path), "-m", "3", "--mem-limit", "1p", "-t", "1",
                          "-o", str(tmp_path / "s.json")], capture_output=True, text=True, env={**_env(), "COLUMNS": "300"})
    assert out.returncode == 0, out.stderr
    assert "bound (under limit, without recomputation)" in out.stdout
    assert "recomputation not searched (--recompute none)" in out.stdout


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
