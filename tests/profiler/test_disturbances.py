"""The profiler times the fused backward too, and says when a measurement was disturbed."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from zbsearch.profiler.measure import SPREAD_LIMIT, StageMeasurement, Stats, disturbances, measure_stage


def test_measure_stage_times_the_fused_backward_and_the_profile_carries_it():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    m = measure_stage(block, (torch.randn(8, 16, requires_grad=True),), None, torch.device("cpu"), warmup=1, repeat=3)
    cost = m.cost()
    assert cost.t_bw == m.bw.mean > 0
    assert m.record()["t_bw"]["q1"] <= m.record()["t_bw"]["median"] <= m.record()["t_bw"]["q3"]


def test_measure_stage_times_the_forward_before_a_fused_backward_alone(monkeypatch):
    """t_ff is the fused forward's own time: a fake clock that each pass (and the release of
    the split pass before it) advances by a known amount gives every time exactly."""
    import types
    import weakref

    from zbsearch.distributed import clock as device_clock
    from zbsearch.profiler import measure

    now = [0.0]
    monkeypatch.setattr(device_clock, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def advancing(fn, ms, on_free_ms=None):
        def run(*args, **kw):
            out = fn(*args, **kw)
            split = kw.get("split", True)
            now[0] += (ms if split else ms / 2) / 1e3  # a forward: split 5 ms, fused 2.5 ms
            if on_free_ms is not None and split:
                weakref.finalize(out, lambda: now.__setitem__(0, now[0] + on_free_ms / 1e3))
            return out
        return run

    monkeypatch.setattr(measure, "forward_pass", advancing(measure.forward_pass, 5.0, on_free_ms=100.0))
    monkeypatch.setattr(measure, "backward_input", advancing(measure.backward_input, 1.0))
    monkeypatch.setattr(measure, "backward_weight", advancing(measure.backward_weight, 2.0))
    monkeypatch.setattr(measure, "backward_full", advancing(measure.backward_full, 4.0))
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    m = measure_stage(block, (torch.randn(8, 16, requires_grad=True),), None, torch.device("cpu"), warmup=1, repeat=3)
    cost = m.cost()
    assert (cost.t_f, cost.t_b, cost.t_w, cost.t_bw, cost.t_ff) == pytest.approx((5.0, 1.0, 2.0, 4.0, 2.5))
    rec = m.record()["t_ff"]
    assert rec["q1"] == pytest.approx(2.5) and rec["q3"] == pytest.approx(2.5)


def test_a_pass_costs_its_mean_time_a_slow_repetition_included():
    """A step pays every pass, the occasional slow one too: the cost is the mean, the median
    and quartiles stay in the record."""
    quick, slow = Stats.of([2.0, 2.0, 2.0, 8.0]), Stats.of([0.0, 0.0, 0.0, 0.0])
    m = StageMeasurement(quick, slow, quick, quick, quick, 1.0, -0.5, 0.0, 4)
    cost = m.cost()
    assert cost.t_f == cost.t_w == cost.t_bw == cost.t_ff == 3.5 and m.record()["t_f"]["median"] == 2.0
    assert cost.t_b > 0  # an empty pass is floored: a profile's times are positive


def test_measure_stage_records_the_forward_before_a_fused_backward():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    m = measure_stage(block, (torch.randn(8, 16, requires_grad=True),), None, torch.device("cpu"), warmup=1, repeat=3)
    rec = m.record()["t_ff"]
    assert m.cost().t_ff == m.ff.mean == rec["mean"] > 0
    assert rec["q1"] <= rec["median"] <= rec["q3"]


def test_the_profiler_runs_each_pass_as_the_runtime_does_and_leaves_no_graph_behind(monkeypatch):
    """Every forward it times is metered as the runtime's (a BW's forward included: the meter's
    hooks are part of what a pass costs), the fused one unsplit as for a BW action, and after
    its repetitions no gradient holds a graph (which kept every microbatch's alive)."""
    from zbsearch.profiler import measure
    from zbsearch.runtime.memory import ActivationMeter

    seen = []
    real = measure.forward_pass

    def spy(*args, **kw):
        seen.append((kw.get("split", True), type(kw.get("meter")).__name__))
        return real(*args, **kw)

    monkeypatch.setattr(measure, "forward_pass", spy)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    measure_stage(block, (torch.randn(8, 16, requires_grad=True),), None, torch.device("cpu"), warmup=1, repeat=3)
    assert seen == [(True, ActivationMeter.__name__), (False, ActivationMeter.__name__)] * 4
    assert all(p.grad is not None and not p.grad.requires_grad for p in block.parameters())


def _stage(spread: float) -> StageMeasurement:
    calm = Stats(10.0, 9.9, 10.1, 10.0)
    wide = Stats(10.0, 10.0 - 10.0 * spread, 10.0 + 10.0 * spread, 10.0)
    return StageMeasurement(calm, wide, calm, calm, calm, 1.0, -0.5, 0.0, 4)


def test_spread_above_the_limit_is_named_by_stage_and_pass(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    cpu = torch.device("cpu")
    assert disturbances([_stage(SPREAD_LIMIT / 2)], cpu, threads=1, ranks=1) == []
    found = disturbances([_stage(SPREAD_LIMIT / 2), _stage(2 * SPREAD_LIMIT)], cpu, threads=1, ranks=2)
    assert len(found) == 1 and found[0].startswith("stage 1 B: spread ±20%")


def test_threads_beyond_cores_and_a_busy_machine_are_warned(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cpu, calm = torch.device("cpu"), [_stage(0.0)]
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert "3 torch threads on 2 cores" in disturbances(calm, cpu, threads=3, ranks=1)[0]
    assert "4 ranks x 1 torch threads exceed the 2 cores" in disturbances(calm, cpu, threads=1, ranks=4)[0]
    assert disturbances(calm, cpu, threads=1, ranks=2) == []
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 0.0, 0.0))
    assert disturbances(calm, cpu, threads=1, ranks=2) == [
        "the machine is busy (1-minute load average 7.5 on 2 cores): times include waiting for a core"]


def test_a_disturbed_link_is_warned_and_a_local_hand_over_is_not(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    calm = [_stage(0.0)] * 3
    steady, noisy = Stats(1.0, 0.98, 1.02, 1.0), Stats(1.0, 0.5, 1.5, 1.0)
    assert disturbances(calm, torch.device("cpu"), threads=1, ranks=2, links=[steady, None]) == []
    assert disturbances(calm, torch.device("cpu"), threads=1, ranks=2, links=[None, noisy]) == [
        "link 1 -> 2: spread ±50% of the median (above 10%): the transfer time was disturbed"]
    # the host time per message sent or received, pooled over both ends of a link; its spread
    # counts against the forwards it was measured with (10 ms here): ±0.5 ms is 50% of its own
    # median, not a warning
    assert disturbances(calm, torch.device("cpu"), threads=1, ranks=2, host=[("send", 0, steady), ("recv", 1, noisy)]) == []
    wild = Stats(1.0, -1.0, 3.0, 1.0)
    host = [("send", 0, steady), ("recv", 1, wild)]
    assert disturbances(calm, torch.device("cpu"), threads=1, ranks=2, host=host) == [
        "link 1 -> 2: the host time of receiving a message spread ±20% of the shorter forward at its ends (above 10%): "
        "t_recv was disturbed"]
    # against the shorter forward at either end: ±0.75 ms is 7.5% of 10 ms, but 19% of a quick
    # receiving stage's 4 ms (the gradients coming back were sent from there)
    uneven = [("send", 1, Stats(1.0, 0.25, 1.75, 1.0))]
    assert disturbances(calm, torch.device("cpu"), threads=1, ranks=2, host=uneven) == []
    quick = [_stage(0.0), _stage(0.0), StageMeasurement(*[Stats(4.0, 4.0, 4.0, 4.0)] * 5, 1.0, -0.5, 0.0, 4)]
    assert disturbances(quick, torch.device("cpu"), threads=1, ranks=2, host=uneven) == [
        "link 1 -> 2: the host time of sending a message spread ±19% of the shorter forward at its ends (above 10%): "
        "t_send was disturbed"]


@pytest.mark.parametrize("seed", range(10))
def test_the_spread_of_a_negligible_pass_is_no_warning(monkeypatch, seed):
    """A pass under NEGLIGIBLE_SHARE of its stage's F + B + W (a first stage's B with no input
    gradient: microseconds, timer-resolution sized) spreads widely without any disturbance:
    no warning, whatever its spread; any pass above that share with the same spread is warned."""
    import random

    from zbsearch.tolerances import NEGLIGIBLE_SHARE

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    rng = random.Random(seed)

    def steady(x: float) -> Stats:
        return Stats(x, 0.99 * x, 1.01 * x, x)

    def wild(x: float) -> Stats:
        spread = rng.uniform(2, 8) * SPREAD_LIMIT
        return Stats(x, x * (1 - spread), x * (1 + spread), x)

    f, w = rng.uniform(1, 50), rng.uniform(1, 50)
    for share, warned in ((NEGLIGIBLE_SHARE * rng.uniform(1e-4, 0.9), False), (NEGLIGIBLE_SHARE * rng.uniform(1.2, 5), True)):
        b = share * (f + w) / (1 - share)  # B's share of F + B + W
        stage = StageMeasurement(steady(f), wild(b), steady(w), steady(f + w), steady(f), 1.0, -0.5, 0.0, 4)
        found = disturbances([stage], torch.device("cpu"), threads=1, ranks=1)
        assert bool(found) == warned and all(x.startswith("stage 0 B: spread") for x in found), (share, found)


@pytest.mark.parametrize("recompute", [False, True])
def test_no_timed_pass_follows_a_synchronisation(monkeypatch, recompute):
    """On CUDA a synchronisation leaves the device idle until the host launches the next pass,
    a wait no training step has: the first pass timed after one ran at the host's speed (a
    split F with its deferral's host work). A recording clock shows every time read spans no
    synchronisation and is read only once the device has reached it (after a sync)."""
    from zbsearch.profiler import measure

    log: list[tuple] = []

    class Recording:
        cuda = False

        def __init__(self, device):
            self.n = 0

        def mark(self):
            self.n += 1
            log.append(("mark", self.n))
            return self.n

        def sync(self):
            log.append(("sync", self.n))

        def ms(self, a, b):
            log.append(("read", a, b))
            return float(b - a)

    monkeypatch.setattr(measure, "DeviceClock", Recording)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    measure_stage(block, (torch.randn(8, 16, requires_grad=True),), None, torch.device("cpu"), warmup=2, repeat=4,
                  recompute_too=recompute)
    syncs = [n for kind, n, *_ in log if kind == "sync"]
    reads = [(i, a, b) for i, (kind, *rest) in enumerate(log) if kind == "read" for a, b in [rest]]
    assert reads and syncs
    for i, a, b in reads:
        assert not any(a <= n < b for n in syncs), (a, b, syncs)  # no sync inside the pass timed
        assert a - 1 not in syncs, (a, syncs)  # nor right before it: an untimed pass comes first
        assert any(kind == "sync" and n >= b for kind, n, *_ in log[:i])  # read once reached
