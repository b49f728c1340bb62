"""Classic schedules against the closed forms of REFERENCE.md section 3 (T_comm = 0)."""

import pytest

from tests.helpers import make_profile
from zbsearch import CLASSIC_KINDS, build_classic, find_problem, timeline

# ZB-H1 closed form assumes T_W <= T_F and T_W <= T_B (W fits the gaps it fills).
TIMES = [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (1.5, 1.2, 0.9)]


def _bubble(kind, p, f, b, w, v=2):
    return {
        "1f1b": (p - 1) * (f + b + w),
        "gpipe": (p - 1) * (f + b + w),
        "zb-h1": (p - 1) * (f + b - w),
        "zb-h2": (p - 1) * (f + b - 2 * w),
        "interleaved-1f1b": (p - 1) * (f + b + w) / v,
    }[kind]


def _peak(kind, p, m, v=2):
    return {"1f1b": p, "gpipe": m, "zb-h1": p, "zb-h2": 2 * p - 1}[kind]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_unit_time_closed_forms(kind, p):
    m = 3 * p
    sched = build_classic(kind, make_profile(p), m)
    span = max(sched.predicted.span)
    assert span == pytest.approx(3 * m + _bubble(kind, p, 1, 1, 1), abs=1e-9)
    # Peak activations counted until W frees them: F allocates 1, B frees 0.6, W the last 0.4.
    assert sched.predicted.peak_memory[0] == pytest.approx(_peak(kind, p, m), abs=1e-9)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("f, b, w", TIMES)
def test_closed_forms_with_unequal_times(kind, f, b, w):
    p, m = 4, 12
    sched = build_classic(kind, make_profile(p, f, b, w), m)
    assert max(sched.predicted.span) == pytest.approx(m * (f + b + w) + _bubble(kind, p, f, b, w), abs=1e-9)


def test_zb_h2_is_zero_bubble_when_w_fills_the_gap():
    # (p-1)(F+B-2W) = 0 when 2W = F+B.
    sched = build_classic("zb-h2", make_profile(4, 1.0, 1.0, 1.0), 16)
    assert sched.predicted.bubble_rate == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 3), (3, 4)])
def test_interleaved_closed_form(p, v):
    m = 2 * p
    sched = build_classic("interleaved-1f1b", make_profile(p), m, chunks=v)
    assert max(sched.predicted.span) == pytest.approx(3 * m + _bubble("interleaved-1f1b", p, 1, 1, 1, v), abs=1e-9)
    assert sched.num_stages == p * v and sched.stage_to_rank[p] == 0


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_zero_bubble_at_1f1b_memory(p):
    m = 2 * p
    sched = build_classic("zb-v", make_profile(p), m)
    assert max(sched.predicted.span) == pytest.approx(3 * m, abs=1e-9)
    assert max(sched.predicted.peak_memory) <= p + 1e-9
    assert sched.stage_to_rank == list(range(p)) + list(reversed(range(p)))


@pytest.mark.parametrize("kind", CLASSIC_KINDS)
def test_every_classic_kind_validates_with_comm(kind):
    prof = make_profile(4, 1.3, 1.1, 0.7, t_comm=0.05, keep=0.125)
    sched = build_classic(kind, prof, 8)
    assert find_problem(sched) is None
    tl = timeline(sched)
    assert tl.makespan >= max(sched.predicted.span)


def test_limits_stated():
    from zbsearch import ZbError

    with pytest.raises(ZbError, match="multiple of p"):
        build_classic("interleaved-1f1b", make_profile(4), 6)
    with pytest.raises(ZbError, match="unknown schedule kind"):
        build_classic("zb-h3", make_profile(4), 6)
    with pytest.raises(ZbError, match="chunks"):
        build_classic("zb-h1", make_profile(4), 8, chunks=2)


# the second profile: a heavy W on the middle stage, where split 1F1B is faster than ZB-H1
@pytest.mark.parametrize("times, m", [([(1.0, 1.0, 1.0)] * 4, 6), ([(1.8, 0.8, 0.5), (1.8, 2.6, 5.6), (0.4, 2.8, 0.4)], 2)])
def test_a_kind_names_one_order(times, m):
    # Both run min(m, p - r) forwards on rank r before its first B; ZB-H1 lags W by r microbatches,
    # split 1F1B runs each W right after its B, whichever is faster on the profile.
    p = len(times)
    prof = make_profile(p, stages=times)
    for kind in ("zb-h1", "1f1b-split"):
        rows = build_classic(kind, prof, m).rank_actions
        for r, row in enumerate(rows):
            assert next(i for i, a in enumerate(row) if a.op.value == "B") == min(m, p - r), kind
            w_after_b = [row[i + 1].op.value == "W" for i, a in enumerate(row) if a.op.value == "B"]
            assert all(w_after_b) == (kind == "1f1b-split" or r == 0), kind
