"""Per-layer profiles at several microbatch sizes: the costs at another size, against the
analytic Llama's own costs at that size (its times and activations are linear in the size)."""

from __future__ import annotations

import pytest

from tests.helpers.layers import random_layers
from zbsearch.errors import ZbError
from zbsearch.planner import llama_layers
from zbsearch.tuner import SizedLayers

_FIELDS = ("t_f", "t_b", "t_w", "t_bw", "t_ff", "t_r", "m_f", "m_b", "m_w", "m_fc", "output_bytes")


def _llama(b: int):
    return llama_layers(3, 256, 1000, heads=4, seq=128, microbatch_size=b, tflops=50, name="tiny")


def _same_costs(got, want):
    for u, w in zip(got.units, want.units):
        for f in _FIELDS:
            a, b = getattr(u, f), getattr(w, f)
            assert (a is None) == (b is None), (u.name, f)
            if a is not None:
                assert a == pytest.approx(b, rel=1e-9, abs=1e-5), (u.name, f)  # the embedding's B: a 1e-6 floor
        assert (u.params, u.param_bytes) == (w.params, w.param_bytes)


@pytest.mark.parametrize("measured, b, how", [
    ((1, 4), 2, "interpolated"), ((1, 2), 4, "extrapolated"), ((2, 4), 1, "extrapolated"), ((2,), 6, "proportional"),
    ((1, 2, 8), 4, "interpolated"), ((1, 2, 4), 2, "measured"),
])
def test_costs_at_another_size_are_the_model_at_that_size(measured, b, how):
    sized = SizedLayers([_llama(x) for x in reversed(measured)])
    assert sized.measured == sorted(measured) and sized.how(b) == how
    got = sized.at(b)
    assert got.microbatch_size == b and got.model["microbatch_size"] == b
    _same_costs(got, _llama(b))


def test_extrapolated_units_stay_valid():
    small = random_layers(3, 4, recompute="full").model_copy(update={"microbatch_size": 2})
    big = random_layers(3, 4, recompute="full").model_copy(update={"microbatch_size": 4})
    big = big.model_copy(update={"units": [u.model_copy(update={"t_w": u.t_w / 10, "m_f": u.m_f * 3, "m_b": -u.m_f * 3 * 0.5,
                                                                  "m_w": -u.m_f * 3 * 0.5}) for u in big.units]})
    sized = SizedLayers([small, big])
    for b in (1, 8, 16):  # far out: every field clamped into what a unit may hold
        for u in sized.at(b).units:
            assert u.t_f > 0 and u.t_w >= 0 and u.m_f >= 0 and 0 <= u.m_fc <= u.m_f
            assert u.m_f + u.m_b + u.m_w == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("edit, words", [
    (lambda p: p.model_copy(update={"microbatch_size": None}), "does not say its microbatch size"),
    (lambda p: p.model_copy(update={"microbatch_size": 1}), "are both at microbatch size 1"),
    (lambda p: llama_layers(4, 256, 1000, heads=4, seq=128, microbatch_size=2, tflops=50), "have different units"),
    (lambda p: llama_layers(3, 512, 1000, heads=4, seq=128, microbatch_size=2, tflops=50), "differ in unit"),
    (lambda p: llama_layers(3, 256, 1000, heads=4, seq=128, microbatch_size=2, tflops=50, recompute=False),
     "has full recomputation costs in one and not the other"),
])
def test_profiles_that_do_not_belong_together_are_refused_in_one_line(edit, words):
    with pytest.raises(ZbError, match=words) as e:
        SizedLayers([_llama(1), edit(_llama(2))])
    assert "\n" not in str(e.value)


def test_no_profile_and_no_size_are_refused():
    with pytest.raises(ZbError, match="at least one"):
        SizedLayers([])
    with pytest.raises(ZbError, match="at least 1 sequence"):
        SizedLayers([_llama(1)]).at(0)
