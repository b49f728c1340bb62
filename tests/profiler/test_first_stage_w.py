"""A first stage's W (its whole backward) runs plain or deferred, whichever the profiler
measures faster; the profile says which, and records the way not taken."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from zbsearch.distributed import clock as device_clock
from zbsearch.profiler import measure
from zbsearch.profiler.measure import measure_stage


def _first_stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(13, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


@pytest.mark.parametrize(("plain_w", "deferred_w"), [(3.0, 2.0), (2.0, 3.0)])
def test_the_faster_way_is_kept_and_the_other_recorded(monkeypatch, plain_w, deferred_w):
    """A fake clock that each pass advances by a known time (W by the way it runs): the stage
    keeps the cheaper way's times, exactly, and records the other's."""
    now = [0.0]
    monkeypatch.setattr(device_clock, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def advancing(fn, ms):
        def run(*args, **kw):
            out = fn(*args, **kw)
            now[0] += ms(*args, **kw) / 1e3
            return out
        return run

    way = []  # how the last forward's W will run

    def f_time(*args, **kw):
        way.append(kw.get("deferred_first", False))
        return 5.0

    def w_time(w):
        return deferred_w if way[-1] else plain_w

    monkeypatch.setattr(measure, "forward_pass", advancing(measure.forward_pass, f_time))
    monkeypatch.setattr(measure, "backward_input", advancing(measure.backward_input, lambda *a: 0.5))
    monkeypatch.setattr(measure, "backward_weight", advancing(measure.backward_weight, w_time))
    monkeypatch.setattr(measure, "backward_full", advancing(measure.backward_full, lambda *a: 4.0))
    m = measure_stage(_first_stage(), (torch.randint(0, 13, (4, 6)),), None, torch.device("cpu"), warmup=1, repeat=4)
    cost = m.cost()
    assert cost.deferred_first is (deferred_w < plain_w)
    assert (cost.t_f, cost.t_b, cost.t_w) == pytest.approx((5.0, 0.5, min(plain_w, deferred_w)))
    other = m.record()["not_taken"]
    assert other["w"] == ("plain" if cost.deferred_first else "deferred")
    assert other["t_w"]["mean"] == pytest.approx(max(plain_w, deferred_w))


def test_both_ways_run_in_alternating_order_on_a_first_stage_only(monkeypatch):
    seen: list[tuple[bool, bool]] = []
    real = measure.forward_pass

    def spy(*args, **kw):
        seen.append((kw.get("split", True), kw.get("deferred_first", False)))
        return real(*args, **kw)

    monkeypatch.setattr(measure, "forward_pass", spy)
    m = measure_stage(_first_stage(), (torch.randint(0, 13, (4, 6)),), None, torch.device("cpu"), warmup=1, repeat=3)
    assert seen == [(True, False), (True, True), (False, False), (True, True), (True, False), (False, False)] * 2
    assert m.not_taken is not None
    cost = [st.mean for st in (m.f, m.b, m.w)]
    assert sum(cost) <= sum(st.mean for st in m.not_taken)  # means: what a schedule pays
    seen.clear()
    middle = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    m = measure_stage(middle, (torch.randn(4, 16, requires_grad=True),), None, torch.device("cpu"), warmup=1, repeat=3)
    assert seen == [(True, False), (False, False)] * 4
    assert m.not_taken is None and not m.cost().deferred_first and "not_taken" not in m.record()
