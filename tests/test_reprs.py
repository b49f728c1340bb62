"""The reprs a notebook user sees: one short line with the key facts, never the arrays behind them."""

from __future__ import annotations

import random

import pytest

from tests.helpers import make_profile
from zbsearch import CostModel, Schedule, build_classic, load_profile, parse_memory_limit, timeline, with_prediction
from zbsearch.classic import CLASSIC_KINDS, KINDS
from zbsearch.formats.profile import Profile, StageCost
from zbsearch.formats.schedule import SolverInfo

_LONGEST = 160  # characters: one line in a notebook, whatever the size of the schedule


def _random_profile(rng: random.Random, p: int, unit: str) -> Profile:
    scale = 2**20 if unit == "bytes" else 1.0
    stages = []
    for _ in range(p):
        m_f, m_w = rng.uniform(0.5, 2) * scale, -rng.uniform(0, 0.5) * scale
        stages.append(StageCost(t_f=rng.uniform(0.5, 3), t_b=rng.uniform(0.5, 3), t_w=rng.uniform(0.1, 2),
                                m_f=m_f, m_b=-m_f - m_w, m_w=m_w))
    return Profile(name=f"random-{p}", memory_unit=unit, stages=stages, t_comm=rng.uniform(0, 0.3))


def _one_short_line(text: str) -> None:
    assert "\n" not in text and len(text) <= _LONGEST, text


@pytest.mark.parametrize("seed", range(12))
def test_schedule_repr_states_the_key_facts(seed):
    rng = random.Random(seed)
    p = rng.choice([2, 3, 4, 8])
    profile = _random_profile(rng, p, rng.choice(["bytes", "activations"]))
    kind = rng.choice([k for k in CLASSIC_KINDS if k != "interleaved-1f1b" and not KINDS[k].recompute])
    m = rng.randint(1, 3) * 2 * p
    sched = build_classic(kind, profile, m)
    text = repr(sched)
    _one_short_line(text)
    assert str(sched) == text
    assert text.startswith(f"Schedule({kind!r}, ")
    for fact in (f"ranks={p}", f"stages={sched.num_stages}", f"microbatches={m}", "limit=none"):
        assert fact in text
    assert sched.predicted is not None
    assert f"span={max(sched.predicted.span):.4g} ms" in text
    assert f"bubble={sched.predicted.bubble_rate:.2%}" in text
    assert "[" not in text and str(sched.rank_actions[0][0]) not in text


def test_schedule_repr_gives_the_limit_as_asked_or_as_values():
    profile = make_profile(4)
    sched = build_classic("zb-h1", profile, 8)
    cost = CostModel.from_profile(profile, sched.stage_to_rank)
    limit = parse_memory_limit("2p", profile, cost)
    asked = sched.model_copy(update={"memory_limit": limit, "memory_limit_spec": "2p"})
    assert "limit=2p" in repr(asked)
    bare = sched.model_copy(update={"memory_limit": [3.0, 3.0, 3.0, 5.0]})
    assert "limit=3-5 activations" in repr(bare)
    gib = Schedule.build("zb-h1", _random_profile(random.Random(0), 4, "bytes"), 8, sched.stage_to_rank,
                         sched.rank_actions, memory_limit=[2**31] * 4)
    assert "limit=2 GiB" in repr(gib) and "span" not in repr(gib)  # not predicted yet
    assert "span=" in repr(with_prediction(gib))


def test_solved_schedule_repr_names_its_status_and_gap():
    profile = make_profile(2)
    sched = build_classic("zb-h1", profile, 4)
    info = SolverInfo(method="heuristic", construction="x", objective="span", status="optimal", value=1.0,
                      lower_bound=1.0, gap=0.0, time_s=0.1, time_limit_s=1.0, memory_limit="1p", uniform_costs=True)
    text = repr(sched.model_copy(update={"solver": info}))
    _one_short_line(text)
    assert "solver=optimal (gap 0.00%)" in text


def test_repr_length_does_not_grow_with_the_schedule():
    big = build_classic("1f1b", make_profile(32), 256)
    _one_short_line(repr(big))
    _one_short_line(repr(big.profile))
    _one_short_line(repr(timeline(big)))
    _one_short_line(repr(CostModel.from_profile(big.profile, big.stage_to_rank)))


@pytest.mark.parametrize("name", ["1.5b-m24", "unit-p4", "cpu-gpt-tiny"])
def test_profile_repr(name):
    profile = load_profile(name)
    text = repr(profile)
    _one_short_line(text)
    assert str(profile) == text
    assert text.startswith(f"Profile({profile.name!r}, stages={profile.num_stages}")
    assert f"memory_unit={profile.memory_unit!r}" in text
    n = profile.num_stages
    f = sum(st.t_f for st in profile.stages) / n
    assert f"mean F/B/W {f:.4g}/" in text


def test_profile_repr_says_when_its_stages_are_pieces():
    profile = make_profile(4).model_copy(update={"placement": [0, 1, 1, 0]})
    assert "stages=4 (pieces on 2 ranks)" in repr(profile)


@pytest.mark.parametrize("seed", range(8))
def test_timeline_repr_matches_the_timeline(seed):
    rng = random.Random(seed)
    p = rng.choice([2, 4, 5])
    sched = build_classic(rng.choice(["1f1b", "zb-h1", "zb-h2", "gpipe"]), _random_profile(rng, p, "activations"), 2 * p)
    tl = timeline(sched)
    text = repr(tl)
    _one_short_line(text)
    assert text.startswith(f"Timeline(ranks={p}, actions={sum(map(len, sched.rank_actions))}, ")
    assert f"span={max(tl.span):.4g} ms" in text
    assert f"bubble={tl.bubble_rate:.2%}" in text
    assert f"peak_memory={max(tl.peak_memory):.4g}" in text


def test_cost_model_repr():
    profile = make_profile(4, t_f=1.0, t_b=2.0, t_w=0.5, t_comm=0.25)
    cost = CostModel.from_profile(profile, [0, 1, 2, 3, 3, 2, 1, 0])  # V: each stage cut in two
    text = repr(cost)
    _one_short_line(text)
    assert text == "CostModel(ranks=4, stages=8, mean F/B/W 0.5/1/0.25 ms, mean link 0.25 ms)"
    local = CostModel.from_profile(make_profile(1), [0])
    assert "link" not in repr(local)
