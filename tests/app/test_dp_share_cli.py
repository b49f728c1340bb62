"""--dp-share and --ranks-per-link: how the reductions priced from --dp-bandwidth share a link,
given on the command line. The profile's ``data_parallel.sharing`` record holds them, and every
command's prediction is checked against the exact event-by-event reference of
``tests/test_lane_sharing.py``, with the links worked out here from the options."""

from __future__ import annotations

import json

import pytest

import zbsearch as zb
from tests.helpers import run_main as _run
from tests.helpers.layers import random_layers
from tests.test_lane_sharing import _reference
from zbsearch.formats.layers import save_layers

DP = ["--dp", "8", "--dp-bandwidth", "25", "--grad-bytes", "3GB"]


def _check_prediction(sched: zb.Schedule, share: float, per_link: int | None) -> list[float]:
    """Assert the schedule's predicted iteration is the reference's with ``per_link`` consecutive
    ranks on a link (None: all) at ``share``; return the reference's per-rank iterations."""
    cost = zb.CostModel.from_profile(sched.profile, sched.stage_to_rank)
    R = sched.num_ranks
    link = [r // (per_link or R) for r in range(R)]
    want = [finish - (begin if begin is not None else start[0])
            for start, _, _, _, finish, begin in _reference(sched.rank_actions, cost, link, share)]
    assert sched.predicted is not None and sched.predicted.iteration == pytest.approx(want, abs=1e-6)
    return want


@pytest.mark.parametrize("kind, share, per_link, shard", [
    ("1f1b-split", 1.0, None, False), ("zb-h1", 0.5, 2, False), ("zb-h2", 1.5, 4, True), ("zb-v", 1.0, 2, True)])
def test_schedule_records_the_share_and_predicts_with_it(tmp_path, capsys, kind, share, per_link, shard):
    out = tmp_path / "s.json"
    extra = ["--dp-share", str(share), *(["--ranks-per-link", str(per_link)] if per_link else []),
             *(["--shard"] if shard else [])]
    code, _, err = _run(capsys, "schedule", kind, "-p", "1.5b-m24", "-m", "8", *DP, *extra, "-o", out)
    assert code == 0, err
    sched = zb.load_schedule(out)
    sharing = sched.profile.data_parallel.sharing
    assert (sharing.share, sharing.ranks_per_link, sharing.measured) == (share, per_link, None)
    shared = _check_prediction(sched, share, per_link)
    # the same schedule with every lane alone: never later, and here earlier (runs at once on a link)
    code, text, _ = _run(capsys, "simulate", out, *DP, *(["--shard"] if shard else []), "--json")
    alone = json.loads(text)["iteration"]
    assert all(a <= s + 1e-9 for a, s in zip(alone, shared)) and max(alone) < max(shared) - 1e-6
    # simulate's options give the same profile again
    code, text, _ = _run(capsys, "simulate", out, *DP, *extra, "--json")
    assert code == 0 and json.loads(text)["iteration"] == pytest.approx(shared)


def test_share_zero_is_recorded_and_changes_nothing(tmp_path, capsys):
    out, plain = tmp_path / "s.json", tmp_path / "p.json"
    assert _run(capsys, "schedule", "zb-h1", "-p", "1.5b-m24", "-m", "8", *DP, "--dp-share", "0", "-o", out)[0] == 0
    assert _run(capsys, "schedule", "zb-h1", "-p", "1.5b-m24", "-m", "8", *DP, "-o", plain)[0] == 0
    sched = zb.load_schedule(out)
    assert sched.profile.data_parallel.sharing.share == 0.0
    assert sched.predicted.iteration == zb.load_schedule(plain).predicted.iteration


def test_solve_and_compare_minimise_and_report_the_shared_iteration(tmp_path, capsys):
    out = tmp_path / "s.json"
    share = ["--dp-share", "1", "--ranks-per-link", "4"]
    code, text, err = _run(capsys, "solve", "-p", "1.5b-m24", "-m", "8", "--mem-limit", "2p", "--no-milp", "-t", "2",
                           *DP, *share, "-o", out)
    assert code == 0, err
    sched = zb.load_schedule(out)
    assert sched.solver.objective == "iteration" and sched.profile.data_parallel.sharing.ranks_per_link == 4
    want = _check_prediction(sched, 1.0, 4)
    assert sched.solver.value == pytest.approx(max(want))
    code, text, _ = _run(capsys, "compare", "-p", "1.5b-m24", "-m", "8", "-t", "1", "--json", *DP, *share)
    rows = {r["kind"]: r for r in json.loads(text) if "iteration" in r}
    for kind in ("1f1b-split", "zb-h1"):
        built = zb.build_classic(kind, sched.profile, 8)
        assert rows[kind]["iteration"] == pytest.approx(max(_check_prediction(built, 1.0, 4)))


@pytest.mark.slow
def test_plan_prices_every_cut_with_the_share(tmp_path, capsys):
    layers, out = tmp_path / "layers.json", tmp_path / "plan.json"
    save_layers(random_layers(7, 6, head=5.0), layers)
    code, _, err = _run(capsys, "plan", "-l", layers, "-r", "2", "-m", "4", "-t", "3", "--placement", "one",
                        "--dp", "4", "--dp-bandwidth", "0.05", "--dp-share", "1", "-o", out)
    assert code == 0, err
    sched = zb.load_schedule(out)
    assert sched.profile.data_parallel.sharing.share == 1.0 and sched.profile.data_parallel.sharing.ranks_per_link is None
    want = _check_prediction(sched, 1.0, None)
    assert sched.partition.objective == "iteration" and sched.partition.value == pytest.approx(max(want))
