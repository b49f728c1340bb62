"""A recompute pass before a fused backward costs the profile's ``t_rf``, before a split one ``t_r``.

Before a fused BW the runtime recomputes with the plain forward (``forward_pass(split=False)``),
as it runs the F of such a microbatch at t_ff. Checked against hand counts of the profile's
fields on many schedules, against older profiles (no t_rf: every R at t_r, as before), against
the emulated stages (which sleep what the cost model says the runtime runs), and the lower
bounds against brute-force optima that choose which backwards to fuse and which microbatches to
recompute, priced with t_rf.
"""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

import zbsearch as zb
from tests.solver.harness import TOL
from tests.solver.oracle import FAMILIES, Instance, brute_force, random_instance, with_fused, with_recompute
from zbsearch.actions import Action, Op, parse_action
from zbsearch.bounds import memory_makespan_lower_bound, memory_span_lower_bound
from zbsearch.formats.profile import Profile, StageCost
from zbsearch.profiler.measure import measure_stage
from zbsearch.runtime import emulation
from zbsearch.runtime.recompute import checkpointed_forward, recompute, recompute_mode
from zbsearch.runtime.split import backward_full, backward_input, backward_weight, fused_forward
from zbsearch.solver import smallest_feasible_limit


def _profile(t_rf: float | None = 0.5, stages: int = 2) -> Profile:
    extra = {"t_fc": 1.25, "t_r": 0.75, "m_fc": 0.125, **({} if t_rf is None else {"t_rf": t_rf})}
    st = StageCost(t_f=1.0, t_b=1.0, t_w=0.5, t_bw=1.25, t_ff=0.875, m_f=1.0, m_b=-0.25, m_w=-0.75, **extra)
    return Profile(name="rf", memory_unit="activations", stages=[st] * stages, t_comm=0.0)


def _rows(text: list[list[str]]) -> list[list[Action]]:
    return [[parse_action(a) for a in row] for row in text]


def test_a_recompute_pass_costs_t_rf_before_a_fused_backward_and_t_r_before_a_split_one():
    cost = zb.CostModel.from_profile(_profile(), [0, 1])
    rows = _rows([["0F0", "0F1", "0R0", "0BW0", "0R1", "0B1", "0W1"], ["1F0", "1BW0", "1F1", "1B1", "1W1"]])
    # 0F0 checkpointed (t_fc, before a BW too), 0F1 checkpointed, 0R0 before a BW: t_rf, 0R1: t_r
    assert cost.durations(rows)[0] == [1.25, 1.25, 0.5, 1.25, 0.75, 1.0, 0.5]
    assert cost.durations(rows)[1] == [0.875, 1.25, 1.0, 1.0, 0.5]


def test_without_t_rf_every_recompute_pass_costs_t_r():
    cost = zb.CostModel.from_profile(_profile(t_rf=None), [0, 1])
    rows = _rows([["0F0", "0R0", "0BW0"], ["1F0", "1BW0"]])
    assert cost.durations(rows)[0] == [1.25, 0.75, 1.25]
    assert cost.offer(0, Op.R).t_rf is None and cost.offer(0, Op.R).least == 0.75


@pytest.mark.parametrize("seed", range(20))
def test_every_recompute_pass_of_a_random_schedule_is_priced_by_its_backward(seed):
    """Random schedules (every pass in a valid order per rank, random choices of fused and
    recomputed microbatches, interleaved stages): each R costs t_rf / k exactly where its
    rank holds a BW of its microbatch on its stage, t_r / k elsewhere; every other pass as
    without t_rf."""
    rng = random.Random(seed)
    p, k, m = rng.choice([2, 3]), rng.choice([1, 2]), rng.randint(1, 4)
    stages = [StageCost(t_f=1.0 + s, t_b=1.0, t_w=0.5, t_bw=1.25, t_ff=0.875, m_f=1.0, m_b=-0.25, m_w=-0.75,
                        t_fc=1.5, t_r=0.75 + s / 8, m_fc=0.125, t_rf=0.25 + s / 16) for s in range(p)]
    prof = Profile(name="rf", memory_unit="activations", stages=stages, t_comm=0.0)
    placement = [s % p for s in range(p * k)]
    cost = zb.CostModel.from_profile(prof, placement)
    old = zb.CostModel.from_profile(prof.model_copy(update={"stages": [st.model_copy(update={"t_rf": None})
                                                                     for st in stages]}), placement)
    rows: list[list[Action]] = [[] for _ in range(p)]
    for s in range(p * k):
        for j in range(m):
            fused, recomputed = rng.random() < 0.5, rng.random() < 0.5
            passes = [Action(s, Op.F, j)] + ([Action(s, Op.R, j)] if recomputed else [])
            passes += [Action(s, Op.BW, j)] if fused else [Action(s, Op.B, j), Action(s, Op.W, j)]
            rows[placement[s]] += passes
    got, before = cost.durations(rows), old.durations(rows)
    for row, dur, dur_old in zip(rows, got, before):
        fused = {(a.stage, a.mb) for a in row if a.op is Op.BW}
        for a, d, d_old in zip(row, dur, dur_old):
            st = stages[a.stage // k]
            if a.op is Op.R:
                want = (st.t_rf if (a.stage, a.mb) in fused else st.t_r) / k
                assert d == pytest.approx(want, rel=1e-12), (a, d, want)
                assert d_old == pytest.approx(st.t_r / k, rel=1e-12)
            else:
                assert d == d_old, a


def test_a_profile_refuses_t_rf_without_t_r():
    with pytest.raises(ValidationError, match="t_rf is given without t_r"):
        StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5, t_rf=0.5)


def test_a_profile_with_t_rf_round_trips(tmp_path):
    path = tmp_path / "rf.json"
    zb.save_profile(_profile(), path)
    back = zb.load_profile(str(path))
    assert back.stages[0].t_rf == 0.5 and back.stages[0].fused_recompute == 0.5
    assert _profile(t_rf=None).stages[0].fused_recompute == 0.75


def test_a_bundled_profile_without_t_rf_prices_every_recompute_pass_at_t_r():
    prof = zb.load_profile("1.5b-m24")  # recomputation costs derived from the paper, no t_rf
    assert all(st.t_rf is None and st.t_r is not None for st in prof.stages)
    p = prof.num_stages
    cost = zb.CostModel.from_profile(prof, list(range(p)))
    rows = [[Action(s, Op.F, 0), Action(s, Op.R, 0), Action(s, Op.BW, 0), Action(s, Op.F, 1), Action(s, Op.R, 1),
             Action(s, Op.B, 1), Action(s, Op.W, 1)] for s in range(p)]
    for s, dur in enumerate(cost.durations(rows)):
        assert dur[1] == dur[4] == prof.stages[s].t_r


def _sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(emulation, "_sleep", lambda seconds: slept.append(seconds))
    return slept


def test_an_emulated_stage_sleeps_t_rf_where_the_runtime_recomputes_for_a_fused_backward(monkeypatch):
    prof = _profile(stages=1)
    stage = emulation.emulated_stages(prof, [0], time_scale=1.0)[0]
    slept = _sleeps(monkeypatch)
    x = torch.ones(2, 16, requires_grad=True)
    for split, want in ((True, 0.75e-3), (False, 0.5e-3)):
        outs, ckpt = checkpointed_forward(stage, [x])
        assert slept[-1] == pytest.approx(1.25e-3)  # t_fc
        slept.clear()
        fp = recompute(ckpt, stage, split=split)
        assert slept == [0.0, pytest.approx(want)], (split, slept)  # W's node sleeps nothing in forward
        grads = [outs[0].new_ones(outs[0].shape)]
        if split:
            _, w = backward_input(fp, grads)
            backward_weight(w)
        else:
            backward_full(fp, grads)
        slept.clear()


def _instance(seed: int) -> tuple[Instance, list[float] | None]:
    """A tiny instance with fused backwards and full recomputation offered, t_rf drawn from a
    sixteenth up to t_r, and a limit from the least with recomputation to 1.5 times the least
    without, or none."""
    rng = random.Random(seed)
    p, m = rng.choice([(1, 2), (2, 1), (3, 1)])
    inst = random_instance(rng, FAMILIES[seed % (3 if p > 1 else 2)], p, m, 1, "none")  # "heavy" needs two stages
    inst = with_recompute(rng, with_fused(rng, inst))
    g = 1 / 16
    stages = [st.model_copy(update={"t_rf": g * rng.randint(1, max(1, round(st.t_r / g)))}) for st in inst.profile.stages]
    prof = inst.profile.model_copy(update={"stages": stages})
    inst = Instance(inst.family, prof, m, 1, None, "none")
    if rng.random() < 0.25:
        return inst, None
    low, high = smallest_feasible_limit(inst.cost, m, "auto"), smallest_feasible_limit(inst.cost, m)
    x = rng.choice([0.0, 0.5, 1.0])
    return inst, [lo + x * (1.5 * hi - lo) for lo, hi in zip(low, high)]


@pytest.mark.parametrize("seed", range(16))
def test_bounds_never_exceed_the_optimum_where_recomputing_before_a_fused_backward_is_cheaper(seed):
    inst, limit = _instance(seed)
    best, _ = brute_force(inst.cost, inst.m, limit, "span", fused=True, recompute=True, max_combinations=400_000)
    bound = memory_span_lower_bound(inst.cost, inst.m, limit)
    assert bound <= best * (1 + TOL), (inst.profile, limit, bound, best)
    best_mk, _ = brute_force(inst.cost, inst.m, limit, "makespan", fused=True, recompute=True, max_combinations=400_000)
    assert memory_makespan_lower_bound(inst.cost, inst.m, limit) <= best_mk * (1 + TOL)


class _Probe(torch.nn.Module):
    """A stage that records, at each forward, whether it runs as a recompute pass and whether
    as the plain forward of a fused backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.seen: list[tuple[str | None, bool]] = []

    def forward(self, x):
        self.seen.append((recompute_mode(), fused_forward()))
        return torch.tanh(self.lin(x))


def test_the_profiler_times_the_recompute_pass_the_runtime_runs_before_a_fused_backward():
    torch.manual_seed(0)
    st = _Probe()
    # activations well above the generator state a checkpoint keeps (else no recomputation is offered)
    x = torch.randn(512, 8, requires_grad=True)
    got = measure_stage(st, (x,), None, torch.device("cpu"), 1, 3, recompute_too=True)
    assert got.cost().t_rf is not None and got.cost().t_rf > 0 and "t_rf" in got.record()
    # per repetition: R as before a split backward, then R as before a fused one (plain forward)
    recomputes = [fused for mode, fused in st.seen if mode == "recompute"]
    assert recomputes == [False, True] * 4
    plain = measure_stage(st, (x,), None, torch.device("cpu"), 1, 2)
    assert plain.cost().t_rf is None and "t_rf" not in plain.record()


def _cheap_recompute(seed: int) -> Profile:
    """Two stages whose checkpointed forward and its recompute pass together cost less than a
    plain forward (t_fc + t_r < t_f; on odd seeds selective recomputation the same)."""
    rng = random.Random(seed)
    stages = []
    for _ in range(2):
        t_f, t_b, t_w = rng.uniform(1.5, 2.5), rng.uniform(1, 2), rng.uniform(0.5, 1)
        extra = {"t_fc": t_f * rng.uniform(0.3, 0.6), "t_r": t_f * rng.uniform(0.2, 0.4), "m_fc": 0.1}
        if seed % 2:
            extra.update(t_fs=t_f * rng.uniform(0.4, 0.7), t_rs=t_f * 0.2, m_fs=0.5)
        stages.append(StageCost(t_f=t_f, t_b=t_b, t_w=t_w, t_ff=t_f * 0.95, m_f=1.0, m_b=-0.4, m_w=-0.6, **extra))
    return Profile(name="cheap-r", memory_unit="activations", stages=stages, t_comm=0.1)


@pytest.mark.parametrize("seed", range(3))
def test_bounds_hold_where_a_checkpointed_forward_and_its_recompute_pass_cost_less_than_a_plain_forward(seed):
    """The bounds take a forward at its least, checkpointed included, and a recompute pass at
    nothing (or, weighing memory, at its least): pricing forwards at min(t_f, t_ff) would put
    the bound above what recomputing every microbatch achieves."""
    cost, m, limit = zb.CostModel.from_profile(_cheap_recompute(seed), [0, 1]), 2, [1.5, 1.5]
    for objective, bound in (("span", memory_span_lower_bound), ("makespan", memory_makespan_lower_bound)):
        best, rows = brute_force(cost, m, limit, objective, recompute=True)
        assert any(a.op in (Op.R, Op.RS) for row in rows for a in row)
        assert bound(cost, m, limit) <= best * (1 + TOL)
        assert bound(cost.without_recompute(), m, None) > best  # forwards at min(t_f, t_ff): above the optimum
