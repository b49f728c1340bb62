"""Profiles of 2P pieces for P ranks (V and interleaved placement) next to the halving rule.

Oracle: a piece profile whose pieces are exactly the halves of a P-stage profile must predict
what halving that P-stage profile predicts (same schedule, same span and memory), for random
profiles; a piece profile whose two halves differ must not. Old files (no placement) load.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbsearch import CostModel, Profile, StageCost, ZbError, build_classic, load_profile
from zbsearch.layout import placement
from zbsearch.solver.solve import solve


def _stage(rng: random.Random) -> tuple[float, float, float, float]:
    return rng.uniform(0.5, 3), rng.uniform(0.5, 3), rng.uniform(0.1, 2), rng.uniform(0.5, 2)


def _cost(t_f, t_b, t_w, m):
    return StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=m, m_b=-0.6 * m, m_w=-0.4 * m)


def _profiles(p: int, seed: int, placement: list[int]):
    """A P-stage profile, and the profile of its 2P halves measured for ``placement``."""
    rng = random.Random(seed)
    whole = [_stage(rng) for _ in range(p)]
    comm = [rng.uniform(0, 0.3) for _ in range(p - 1)]
    coarse = Profile(name="p", memory_unit="activations", stages=[_cost(*s) for s in whole], t_comm=comm)
    halves = [_cost(*(x / 2 for x in s)) for s in whole for _ in range(2)]
    mean = sum(comm) / len(comm) if comm else 0.0
    # boundaries between two halves of one stage cost the mean, the others the stage's boundary
    piece_comm = [comm[b // 2] if b % 2 else mean for b in range(2 * p - 1)]
    pieces = Profile(name="pieces", memory_unit="activations", stages=halves, t_comm=piece_comm, placement=placement)
    return coarse, pieces


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(2, 5),
    m_factor=st.integers(1, 3),
    seed=st.integers(0, 10**6),
    kind=st.sampled_from(["zb-v", "interleaved-1f1b"]),
)
def test_pieces_equal_to_halves_predict_what_halving_predicts(p, m_factor, seed, kind):
    stage_to_rank = placement(p, 2, "v" if kind == "zb-v" else "looped")
    coarse, pieces = _profiles(p, seed, stage_to_rank)
    m = p * m_factor
    a, b = build_classic(kind, coarse, m), build_classic(kind, pieces, m)
    assert b.num_ranks == p and b.num_stages == 2 * p and b.stage_to_rank == a.stage_to_rank
    assert CostModel.from_profile(pieces, b.stage_to_rank) == CostModel.from_profile(coarse, a.stage_to_rank)
    assert a.actions == b.actions
    assert b.predicted.span == pytest.approx(a.predicted.span)
    assert b.predicted.peak_memory == pytest.approx(a.predicted.peak_memory)


def test_uneven_pieces_are_used_as_measured():
    """An embedding piece and a head piece on rank 0 (V): their own costs, not halves."""
    p = 2
    coarse = Profile(name="c", memory_unit="activations", stages=[_cost(2, 2, 1, 1), _cost(2, 2, 1, 1)])
    pieces = Profile(
        name="v", memory_unit="activations", placement=placement(p, 2, "v"),
        stages=[_cost(0.2, 0.2, 0.1, 0.1), _cost(1.8, 1.8, 0.9, 0.9), _cost(1.0, 1.0, 0.5, 0.5), _cost(1.0, 1.0, 0.5, 0.5)],
    )
    cost = CostModel.from_profile(pieces, placement(p, 2, "v"))
    assert cost.t_f == (0.2, 1.8, 1.0, 1.0) and cost.m_f == (0.1, 0.9, 0.5, 0.5)
    assert cost.comm_next[1] == 0.0  # pieces 1 and 2 share rank 1
    halved = CostModel.from_profile(coarse, placement(p, 2, "v"))
    assert halved.t_f == (1.0, 1.0, 1.0, 1.0)
    assert build_classic("zb-v", pieces, 4).predicted.span != build_classic("zb-v", coarse, 4).predicted.span
    # the solver takes the profile's ranks and pieces too
    res = solve(pieces, 4, "2p", chunks=2, time_limit=2, milp=False)
    assert res.schedule.num_ranks == p and res.schedule.stage_to_rank == placement(p, 2, "v")


def test_piece_profile_refuses_other_stage_counts():
    _, pieces = _profiles(2, 0, placement(2, 2, "v"))
    with pytest.raises(ZbError, match="holds 4 pieces measured for 2 ranks"):
        build_classic("1f1b", pieces, 4)
    with pytest.raises(ZbError, match="on 4 ranks needs a profile of 4 stages measured one per rank"):
        CostModel.from_profile(pieces, list(range(4)))


@pytest.mark.parametrize("bad", [[0, 1, 1], [0, 0, 1, 2], [0, 2, 2, 0], [-1, 0, 0, -1]])
def test_placement_checked(bad):
    stages = [_cost(1, 1, 1, 1)] * 4
    with pytest.raises(ValueError):
        Profile(name="x", memory_unit="activations", stages=stages, placement=bad)


def test_old_profile_files_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "zbsearch.profile", "version": 1, "name": "old", "memory_unit": "activations",
                                "stages": [_cost(1, 1, 1, 1).model_dump()] * 3}))
    prof = load_profile(path)
    assert prof.placement is None and prof.num_ranks == 3 and prof.chunks == 1
