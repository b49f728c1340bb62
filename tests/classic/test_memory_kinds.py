"""The classic kinds below 1F1B's memory: V-Half and V-Min (arXiv 2405.15362), DualPipeV, and
1F1B / ZB-H1 with full recomputation, each against something independent of its builder.

* V-Half and V-Min: the bubble rates and peak memory published for the authors' own generator
  (unit costs F = B = W per chunk, no communication, B frees nothing and W frees all).
* DualPipeV: torch's ``ScheduleDualPipeV`` order, and its OVERLAP_F_B actions as our overlapped
  pairs where the profile has all-to-all (F then BW one after the other where it has none).
* Recomputing kinds: the plain order with an R before every backward, and a peak counted by
  hand: (p - 1 - r) checkpointed microbatches plus one rebuilt on rank r.
"""

from __future__ import annotations

import pytest

from tests.helpers import make_profile
from zbsearch import Profile, StageCost, build_classic, find_problem, placement, simulate
from zbsearch.actions import Action, Op
from zbsearch.costs import CostModel


def _unit(p: int) -> Profile:
    """Per chunk (half a profile stage): F = B = W = 1, F allocates 1, B frees nothing, W all."""
    st = StageCost(t_f=2.0, t_b=2.0, t_w=2.0, m_f=2.0, m_b=0.0, m_w=-2.0)
    return Profile(name=f"unit-v{p}", memory_unit="activations", stages=[st] * p)


# (kind, p, m): (published bubble rate, peak memory in chunk activations)
_PUBLISHED = {("v-half", 4, 8): (0.094, 6), ("v-half", 8, 24): (0.106, 10),
              ("v-min", 8, 24): (0.158, 8), ("v-min", 16, 64): (0.133, 12)}


@pytest.mark.parametrize("kind,p,m", list(_PUBLISHED))
def test_controllable_memory_schedules_match_the_published_ones(kind, p, m):
    bubble, peak = _PUBLISHED[(kind, p, m)]
    sched = build_classic(kind, _unit(p), m)
    assert find_problem(sched) is None
    assert sched.predicted.bubble_rate == pytest.approx(bubble, abs=5e-4)
    assert max(sched.predicted.peak_memory) == pytest.approx(peak)  # M_B per rank is 2 chunks: 10 = 5 of 8
    assert max(sched.predicted.peak_memory) <= (((p + 2) // 2) if kind == "v-half" else ((p + 4) // 3)) * 2


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 13), (5, 12)])
def test_dualpipe_v_is_torchs_order(p, m):
    torch = pytest.importorskip("torch.distributed.pipelining.schedules")
    letters = {torch.FORWARD: Op.F, torch.FULL_BACKWARD: Op.BW, torch.BACKWARD_INPUT: Op.B, torch.BACKWARD_WEIGHT: Op.W}

    class Stage:  # what the schedule class reads of a stage
        def __init__(self, i):
            self.stage_index = i

    def flat(acts):
        for a in acts:
            if a is None:
                continue
            if a.computation_type == torch.OVERLAP_F_B:
                yield from flat(a.sub_actions)
            else:
                yield Action(a.stage_index, letters[a.computation_type], a.microbatch_index)

    def pairs(acts):
        at, i = [], 0
        for a in acts:
            if a is None:
                continue
            if a.computation_type == torch.OVERLAP_F_B:
                at.append(i)
            i += len(a.sub_actions) if a.sub_actions else 1
        return at

    sched = build_classic("dualpipe-v", make_profile(p), m)
    assert find_problem(sched) is None and sched.overlapped is None  # nothing to hide: no pairs
    prof = make_profile(p).model_dump()
    for st in prof["stages"]:
        st.update(a_f=0.3, a_b=0.4)
    moe = build_classic("dualpipe-v", Profile.model_validate(prof), m)
    assert find_problem(moe) is None and moe.rank_actions == sched.rank_actions
    ref = torch.ScheduleDualPipeV.__new__(torch.ScheduleDualPipeV)
    ref.pp_group_size, ref._n_microbatches = p, m
    for r in range(p):
        theirs = ref._calculate_single_rank_operations(r)
        assert sched.rank_actions[r] == list(flat(theirs)), r
        assert moe.pairs(r) == pairs(theirs), r
    assert max(moe.predicted.span) < max(sched.predicted.span)


@pytest.mark.parametrize("kind,plain", [("1f1b-recompute", "1f1b"), ("1f1b-split-recompute", "1f1b-split"),
                                        ("zb-h1-recompute", "zb-h1")])
def test_recomputing_kinds_recompute_every_microbatch_just_before_its_backward(kind, plain):
    p, m, keep = 4, 8, 0.125
    prof = make_profile(p, keep=keep, m_w=0.0)  # B frees all: 1F1B and ZB-H1 alike
    sched, base = build_classic(kind, prof, m), build_classic(plain, prof, m)
    assert find_problem(sched) is None
    assert [[a for a in row if a.op is not Op.R] for row in sched.rank_actions] == base.rank_actions
    for row in sched.rank_actions:
        for i, a in enumerate(row):
            if a.op in (Op.B, Op.BW):
                assert row[i - 1] == Action(a.stage, Op.R, a.mb)
    # rank r: p - 1 - r forwards ahead and one more checkpointed, then one rebuilt, m_f = 1
    peaks = simulate(sched.rank_actions, CostModel.from_profile(prof, placement(p))).peak_memory
    assert peaks == pytest.approx([(p - 1 - r) * keep + 1.0 for r in range(p)])
