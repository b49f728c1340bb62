"""The runtime's host time per action (the profile's optional ``t_action``): old profiles are
unchanged, the cost model charges it whole to every pass however finely a stage is cut, the
simulator's timeline with it is the hand-worked one, and ``action_host_times`` reads it from a
trace's gaps, leaving out waits for inputs."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

import zbsearch as zb
from tests.helpers import make_profile
from zbsearch.actions import Action, Op
from zbsearch.costs import CostModel
from zbsearch.formats.edit import updated
from zbsearch.formats.trace import Trace, TraceArgs, TraceEvent, TraceInfo
from zbsearch.layout import placement
from zbsearch.pooling import pool_profiles
from zbsearch.profiler.in_step import action_host_times


def test_a_profile_without_host_time_loads_and_costs_what_it_did(tmp_path):
    prof = make_profile(3, t_comm=[0.1, 0.2])
    path = tmp_path / "p.json"
    zb.save_profile(prof, path)
    loaded = zb.load_profile(path)
    assert loaded.t_action is None
    assert CostModel.from_profile(loaded, [0, 1, 2]) == CostModel.from_profile(updated(prof, t_action=0.0), [0, 1, 2])
    timed = updated(prof, t_action=0.25)
    zb.save_profile(timed, path)
    back = zb.load_profile(path)
    assert back.t_action == 0.25 and back == timed
    assert back.compute_only().t_action is None  # what a trace's spans and emulated stages hold


@pytest.mark.parametrize("bad", [-0.1, float("inf")])
def test_host_time_is_checked_like_message_times(bad):
    with pytest.raises(ValidationError):
        zb.Profile.model_validate(make_profile(2).model_dump() | {"t_action": bad})


def test_pooled_rounds_take_the_median_host_time():
    rounds = [updated(make_profile(2), t_action=x) for x in (0.3, 0.1, 0.2)]
    assert pool_profiles(rounds).t_action == pytest.approx(0.2)
    assert pool_profiles([make_profile(2), make_profile(2)]).t_action is None


def _cases(n):
    rng = random.Random(5)
    for _ in range(n):
        p = rng.choice([2, 3, 4])
        prof = make_profile(p, stages=[(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 1)) for _ in range(p)],
                            t_comm=0.1, keep=rng.choice([None, 0.3]))
        prof = updated(prof, t_send=rng.uniform(0, 0.3), t_recv=rng.uniform(0, 0.3))
        yield rng.choice(["1f1b", "zb-h1", "gpipe", "interleaved", "zb-v"]), prof, rng.uniform(0.01, 0.8), rng.choice([p, 2 * p])


@pytest.mark.parametrize("kind,prof,h,m", list(_cases(30)), ids=lambda x: x if isinstance(x, str) else None)
def test_every_pass_costs_the_host_time_whole_on_every_piece(kind, prof, h, m):
    sched = zb.build_classic(kind, prof, m)
    owner = sched.stage_to_rank
    cost = CostModel.from_profile(updated(prof, t_action=h), owner)
    plain = CostModel.from_profile(prof, owner)
    S = len(owner)
    for s in range(S):  # not 1/k of it on a stage cut into k pieces: the runtime pays it per action
        for op in (Op.F, Op.B, Op.W, Op.BW):
            assert cost.time(s, op) == pytest.approx(plain.time(s, op) + h, abs=1e-12), (s, op)
        assert cost.t_ff[s] == pytest.approx(plain.t_ff[s] + h)
        for op in plain.recompute_ops(s):
            o, o0 = cost.offer(s, op), plain.offer(s, op)
            assert o is not None and o0 is not None
            assert (o.t_f, o.t_r, o.time(fused=True)) == pytest.approx((o0.t_f + h, o0.t_r + h, o0.time(fused=True) + h))
    # a schedule's actions each cost h more, so each rank is busy h per action more
    actions = sum(len(row) for row in sched.rank_actions)
    got = sum(map(sum, cost.durations(sched.rank_actions))) - sum(map(sum, plain.durations(sched.rank_actions)))
    assert got == pytest.approx(h * actions)


def test_the_simulated_1f1b_with_host_time_is_the_hand_worked_timeline():
    """Two ranks, 1F1B, two microbatches, F 1, B 1, W 1 (BW 2), no link, 0.5 ms per action."""
    prof = updated(make_profile(2), t_action=0.5)
    sched = zb.build_classic("1f1b", prof, 2)
    F, BW = Op.F, Op.BW
    assert sched.rank_actions == [[Action(0, F, 0), Action(0, F, 1), Action(0, BW, 0), Action(0, BW, 1)],
                                  [Action(1, F, 0), Action(1, BW, 0), Action(1, F, 1), Action(1, BW, 1)]]
    tl = zb.simulate(sched.rank_actions, CostModel.from_profile(prof, sched.stage_to_rank))
    # F takes 1.5, BW 2.5. Rank 0: F0 0-1.5, F1 1.5-3; rank 1: F0 once rank 0's is done, 1.5-3,
    # BW0 3-5.5, F1 5.5-7, BW1 7-9.5; rank 0: BW0 after rank 1's, 5.5-8, BW1 after rank 1's, 9.5-12.
    assert tl.start == [pytest.approx([0, 1.5, 5.5, 9.5]), pytest.approx([1.5, 3, 5.5, 7])]
    assert tl.end == [pytest.approx([1.5, 3, 8, 12]), pytest.approx([3, 5.5, 7, 9.5])]
    assert tl.makespan == pytest.approx(12.0)  # 9 without the host time


def test_the_v_pays_it_on_twice_the_actions():
    one = updated(make_profile(2, t_f=2.0, t_b=2.0, t_w=2.0), t_action=0.5)
    v = updated(make_profile(4), placement=placement(2, 2, "v"), t_action=0.5)  # half the stage per piece
    for prof, chunks in ((one, 1), (v, 2)):
        sched = zb.build_classic("zb-v" if chunks == 2 else "zb-h1", prof, 4)
        cost, plain = CostModel.from_profile(prof, sched.stage_to_rank), CostModel.from_profile(
            updated(prof, t_action=None), sched.stage_to_rank)
        busy = zb.simulate(sched.rank_actions, cost).busy
        extra = [b - b0 for b, b0 in zip(busy, zb.simulate(sched.rank_actions, plain).busy)]
        assert extra == pytest.approx([0.5 * 3 * 4 * chunks] * 2)  # F, B and W of 4 microbatches on each piece
        # the least a rank can be busy (bounds) fuses each backward: one host time fewer per microbatch and piece
        least = [cost.rank_busy(r, 4) - plain.rank_busy(r, 4) for r in range(2)]
        assert least == pytest.approx([0.5 * 2 * 4 * chunks] * 2)


def _event(a: Action, rank: int, start: float, end: float) -> TraceEvent:
    return TraceEvent(name=str(a), pid=rank, ts=start * 1e3, dur=(end - start) * 1e3,
                      args=TraceArgs(stage=a.stage, op=a.op, mb=a.mb))


@pytest.mark.parametrize("seed", range(10))
def test_host_times_are_the_gaps_before_actions_whose_inputs_were_in(seed):
    """A made-up step of 1F1B on 2 ranks, each rank's actions one after the other: before each a
    host gap drawn at random, plus, where its input came late, a wait. The gaps are read back
    exactly, and no wait among them."""
    rng = random.Random(seed)
    prof = make_profile(2)
    m = rng.choice([2, 3, 4])
    sched = zb.build_classic(rng.choice(["1f1b", "zb-h1"]), prof, m)
    S = sched.num_stages
    # simulate the two ranks by hand: each action starts after its rank's previous end plus a host
    # gap, or after its input's end if that is later (then the gap is a wait, not counted)
    from zbsearch.dependencies import action_predecessor_types

    ends: dict[tuple[int, Op, int], float] = {}
    pos = [0, 0]
    clock = [0.0, 0.0]
    events: list[TraceEvent] = []
    want: list[float] = []
    messages: list[float] = []  # per counted gap, the host time of its messages (t_send 0.1, t_recv 0.05)
    rows = sched.rank_actions

    def sends(a: Action) -> bool:  # two stages on two ranks: F of stage 0 sends on, a backward of stage 1 back
        return (a.op is Op.F and a.stage == 0) or (a.op in (Op.B, Op.BW) and a.stage == 1)

    def receives(a: Action) -> bool:
        return (a.op is Op.F and a.stage == 1) or (a.op in (Op.B, Op.BW) and a.stage == 0)
    while any(pos[r] < len(rows[r]) for r in range(2)):
        progressed = False
        for r in range(2):
            if pos[r] == len(rows[r]):
                continue
            a = rows[r][pos[r]]
            needs = [ends.get((s, op, a.mb)) for s, op in action_predecessor_types(a.stage, a.op, S)]
            if any(x is None for x in needs):
                continue
            ready = max([x for x in needs if x is not None], default=0.0)
            gap = rng.uniform(0.05, 0.5)
            first = pos[r] == 0
            start = max(clock[r] + (0.0 if first else gap), ready + rng.uniform(0.01, 0.3))
            if not first and ready <= clock[r]:
                start = clock[r] + gap
                want.append(gap)
                messages.append(0.1 * sends(rows[r][pos[r] - 1]) + 0.05 * receives(a))
            end = start + rng.uniform(0.5, 2.0)
            events.append(_event(a, r, start, end))
            for op in a.parts():
                ends[(a.stage, op, a.mb)] = end
            clock[r], pos[r] = end, pos[r] + 1
            progressed = True
        assert progressed
    trace = Trace(traceEvents=events, zbsearch=TraceInfo(schedule_kind="x", num_ranks=2, num_stages=S))
    assert sorted(action_host_times([trace])) == pytest.approx(sorted(want))
    assert len(want) > 0
    # with the messages' host time held apart, each gap less that of the messages sent and received in it
    apart = action_host_times([trace], [0, 1], [0.1], [0.05])
    assert sorted(apart) == pytest.approx(sorted(g - x for g, x in zip(want, messages)))
    assert any(messages)


def _steps_with_delay(rank, world, send, delays):
    """On 2 ranks, the profiler's calibration steps of emulated 2 ms stages, the runtime made
    slower by each of ``delays`` seconds per action (slept where it reaps finished sends,
    between two actions); rank 0's host times per delay."""
    import time

    import torch

    from zbsearch.profiler.in_step import calibration_orders, calibration_steps, run_in_steps
    from zbsearch.runtime import emulated_loss, emulated_stages
    from zbsearch.runtime.p2p import P2P

    prof = make_profile(2, t_f=2.0, t_b=2.0, t_w=1.5)
    stages = emulated_stages(prof, [0, 1], bytes_per_unit=1024)
    reap = P2P.reap
    out = []
    for delay in delays:
        def slow(self, *a, delay=delay, **kw):
            time.sleep(delay)
            return reap(self, *a, **kw)

        P2P.reap = slow  # type: ignore[method-assign]
        orders = calibration_orders([0, 1])
        assert orders is not None
        x = torch.zeros(1, 16)
        traces = run_in_steps(orders, {rank: stages[rank]}, (x,) if rank == 0 else (), emulated_loss, x,
                              calibration_steps(10, orders), group=None, device=torch.device("cpu"), timeout=60.0,
                              keep_heap=False)
        out.append(None if traces is None else action_host_times([t for way in traces.values() for t in way]))
    P2P.reap = reap  # type: ignore[method-assign]
    return out


@pytest.mark.slow
def test_a_known_host_time_per_action_is_measured_in_the_runtimes_steps():
    import statistics

    from zbsearch.distributed import run_local

    base, slowed = run_local(_steps_with_delay, 2, [0.0, 0.004], timeout=300)[0]
    assert len(base) >= 10 and len(slowed) >= 10
    assert min(slowed) >= 0.004 * 1e3 - 0.05  # every gap holds the delay: no wait counted as host time
    extra = statistics.median(slowed) - statistics.median(base)
    assert 3.0 <= extra <= 6.0, (statistics.median(base), statistics.median(slowed))


def test_the_profile_summary_shows_the_host_time_where_measured():
    from rich.console import Console

    from zbsearch.profiler.report import summary_table

    def shown(prof: zb.Profile) -> str:
        console = Console(width=200, record=True)
        console.print(summary_table(prof))
        return console.export_text()

    assert "runtime host time per action 0.42 ms" in shown(updated(make_profile(2), t_action=0.42))
    assert "host time per action" not in shown(make_profile(2))
