"""The profile's summary table: a local hand-over is shown as such, and the warnings below it."""

from __future__ import annotations

from rich.console import Console

from zbsearch import Profile, StageCost
from zbsearch.profiler import summary_table


def _text(profile: Profile) -> str:
    console = Console(record=True, width=200)
    console.print(summary_table(profile))
    return console.export_text()


def test_links_between_ranks_have_times_and_pieces_of_one_rank_hand_over_locally():
    cost = StageCost(t_f=1, t_b=1, t_w=1, m_f=4, m_b=-2, m_w=-2)
    prof = Profile(name="v", memory_unit="bytes", stages=[cost] * 4, t_comm=[0.25, 0.0, 0.5], placement=[0, 1, 1, 0],
                   measured={"warnings": ["link 2 -> 3: spread ±50% of the median (above 10%): the transfer time was disturbed"]})
    rows = {line.split()[0]: line.split() for line in _text(prof).splitlines() if line.strip()[:1].isdigit()}
    assert [rows[s][-1] for s in "0123"] == ["0.25", "local", "0.5", "-"]
    assert "warning: link 2 -> 3: spread ±50%" in _text(prof)
    plain = Profile(name="p", memory_unit="bytes", stages=[cost] * 2, t_comm=[0.0])
    assert "local" not in _text(plain)  # a zero link time between two ranks is a time


def test_the_first_stage_w_is_shown_against_the_way_not_taken():
    q = {"median": 1.0, "q1": 1.0, "q3": 1.0}
    spread = {"t_f": q, "t_b": q, "t_w": q}
    first = StageCost(t_f=1, t_b=0.5, t_w=2, m_f=4, m_b=0, m_w=-4, deferred_first=True)
    other = {**spread, "not_taken": {"w": "plain", "t_f": {**q, "mean": 1.0}, "t_b": {**q, "mean": 0.5},
                                     "t_w": {**q, "mean": 3.0}}}
    cost = StageCost(t_f=1, t_b=1, t_w=1, m_f=4, m_b=-2, m_w=-2)
    prof = Profile(name="f", memory_unit="bytes", stages=[first, cost], measured={"stages": [other, spread]})
    assert "stage 0's W runs deferred (the split's fast path): F+B+W 3.5 ms, 4.5 ms plain" in _text(prof)
    assert "stage 0's W" not in _text(Profile(name="g", memory_unit="bytes", stages=[first, cost]))
