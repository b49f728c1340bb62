"""Pass times inside steps (zbsearch.profiler.in_step): the orders the calibration steps run, the
times read from their traces, the stage costs taken from them, and a real run on two ranks."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from torch import nn

import zbsearch as zb
from tests.helpers import check_first_stage_way
from zbsearch.actions import Action, Op
from zbsearch.distributed import run_local
from zbsearch.formats.profile import Quartiles
from zbsearch.formats.trace import Trace, TraceArgs, TraceEvent, TraceInfo
from zbsearch.layout import placement
from zbsearch.models import GPTConfig
from zbsearch.pooling import pool_profiles
from zbsearch.profiler.in_step import IN_STEP_KEYS, calibration_orders, in_step_times
from zbsearch.profiler.measure import StageMeasurement, Stats
from zbsearch.validator import find_problem

TINY = GPTConfig(layers=4, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2, stages=2)


@pytest.mark.parametrize(("ranks", "chunks", "layout"), [(2, 1, "looped"), (3, 1, "looped"), (4, 1, "looped"),
                                                         (2, 2, "v"), (3, 2, "v"), (2, 2, "looped"), (2, 3, "looped")])
def test_the_calibration_orders_are_valid_and_run_every_pass_of_every_stage(ranks, chunks, layout):
    owner = placement(ranks, chunks, layout)
    orders = calibration_orders(owner)
    assert orders is not None and set(orders) == {"split", "fused"}
    m = 2 * ranks
    for way, sched in orders.items():
        assert find_problem(sched) is None, (way, find_problem(sched))
        assert sched.stage_to_rank == owner and sched.num_microbatches == m
        ops = {a.op for row in sched.rank_actions for a in row}
        assert ops == ({Op.F, Op.B, Op.W} if way == "split" else {Op.F, Op.BW})
        for s in range(len(owner)):  # every microbatch's passes of every stage, on its rank
            row = sched.rank_actions[owner[s]]
            for op in ops:
                assert sorted(a.mb for a in row if a.stage == s and a.op is op) == list(range(m))
    # the fused order is the split one with each B made a BW and its W dropped: F's where they were
    forwards = [[a for a in row if a.op is Op.F] for row in orders["split"].rank_actions]
    assert forwards == [[a for a in row if a.op is Op.F] for row in orders["fused"].rank_actions]


def test_a_placement_without_a_textbook_order_is_not_calibrated():
    assert calibration_orders([0, 1, 0, 1, 1, 0]) is None  # neither looped nor a V
    assert calibration_orders([0, 0, 1]) is None  # ranks holding different numbers of stages
    assert calibration_orders([1, 0]) is None


def test_the_first_stage_runs_its_w_the_way_the_profiler_chose():
    for deferred in (False, True):
        orders = calibration_orders([0, 1], deferred)
        assert orders is not None
        assert all(o.profile.stages[0].deferred_first is deferred for o in orders.values())
        assert not any(o.profile.stages[1].deferred_first for o in orders.values())


def _trace(events: list[tuple[int, Op, int, float]], ranks: int) -> Trace:
    evs = [TraceEvent(name=str(Action(s, op, mb)), pid=0, ts=0.0, dur=dur * 1e3, args=TraceArgs(stage=s, op=op, mb=mb))
           for s, op, mb, dur in events]
    return Trace(traceEvents=evs, zbsearch=TraceInfo(schedule_kind="x", num_ranks=ranks))


@pytest.mark.parametrize("seed", range(5))
def test_in_step_times_are_the_traces_statistics_per_stage_and_pass(seed):
    rng = random.Random(seed)
    p = rng.randint(2, 4)
    drawn: dict[tuple[str, int, Op], list[float]] = {}
    traces: dict[str, list[Trace]] = {"split": [], "fused": []}
    for way, ops in (("split", (Op.F, Op.B, Op.W)), ("fused", (Op.F, Op.BW))):
        for _ in range(rng.randint(1, 3)):
            events = [(s, op, mb, rng.uniform(0.1, 5.0)) for s in range(p) for op in ops for mb in range(4)]
            for s, op, _, dur in events:
                drawn.setdefault((way, s, op), []).append(dur)
            traces[way].append(_trace(events, p))
    got = in_step_times(traces, p)
    assert len(got) == p
    for s in range(p):
        assert set(got[s]) == set(IN_STEP_KEYS)
        for key, (way, op) in IN_STEP_KEYS.items():
            want = drawn[(way, s, op)]
            assert got[s][key].mean == pytest.approx(statistics.fmean(want))
            assert got[s][key].median == pytest.approx(statistics.median(want))
    # a way that did not run gives none of its passes
    assert set(in_step_times({"split": traces["split"]}, p)[0]) == {"t_f", "t_b", "t_w"}


def _stats(x: float) -> Stats:
    return Stats(median=x, q1=0.9 * x, q3=1.1 * x, mean=x)


@pytest.mark.parametrize("seed", range(10))
def test_the_costs_are_the_in_step_times_and_recompute_passes_scale_as_the_forward(seed):
    rng = random.Random(seed)
    bare = {k: rng.uniform(0.5, 5.0) for k in ("f", "b", "w", "bw", "ff", "fc", "r", "rf", "fs", "rs")}
    m = StageMeasurement(*(_stats(bare[k]) for k in ("f", "b", "w", "bw", "ff")), m_f=100.0, m_b=-40.0,
                         memory_residual=0.0, output_bytes=8, fc=_stats(bare["fc"]), r=_stats(bare["r"]), m_fc=10.0,
                         fs=_stats(bare["fs"]), rs=_stats(bare["rs"]), m_fs=20.0, rf=_stats(bare["rf"]))
    plain = m.cost()
    assert [plain.t_f, plain.t_b, plain.t_w, plain.t_bw, plain.t_ff] == pytest.approx(
        [bare[k] for k in ("f", "b", "w", "bw", "ff")])
    assert [plain.t_fc, plain.t_r, plain.t_rf, plain.t_fs, plain.t_rs] == pytest.approx(
        [bare[k] for k in ("fc", "r", "rf", "fs", "rs")])
    # the steps' medians, and a slow tail in the steps' means that the costs leave out
    steps = {k: rng.uniform(0.5, 5.0) for k in IN_STEP_KEYS}
    in_step = {k: Stats(median=x, q1=0.9 * x, q3=1.1 * x, mean=x * rng.uniform(1.0, 3.0)) for k, x in steps.items()}
    cal = StageMeasurement(**{**m.__dict__, "in_step": in_step}).cost()
    assert [cal.t_f, cal.t_b, cal.t_w, cal.t_bw, cal.t_ff] == pytest.approx(
        [steps[k] for k in ("t_f", "t_b", "t_w", "t_bw", "t_ff")])
    # the repetitions' tail (mean over median) is kept: the steps scale the mean as they did the median
    tail = StageMeasurement(**{**m.__dict__, "f": Stats(median=bare["f"], q1=bare["f"], q3=bare["f"], mean=1.2 * bare["f"]),
                               "in_step": in_step}).cost()
    assert tail.t_f == pytest.approx(1.2 * steps["t_f"])
    f_scale, ff_scale = steps["t_f"] / bare["f"], steps["t_ff"] / bare["ff"]
    assert [cal.t_fc, cal.t_r, cal.t_fs, cal.t_rs] == pytest.approx(
        [bare[k] * f_scale for k in ("fc", "r", "fs", "rs")])
    assert cal.t_rf == pytest.approx(bare["rf"] * ff_scale)
    assert (cal.m_f, cal.m_b, cal.m_w, cal.m_fc) == (plain.m_f, plain.m_b, plain.m_w, plain.m_fc)
    rec = StageMeasurement(**{**m.__dict__, "in_step": {"t_f": _stats(steps["t_f"])}})
    assert rec.cost().t_b == pytest.approx(bare["b"])  # a pass not timed in steps keeps its repetitions' time
    assert rec.record()["in_step"] == {"t_f": _stats(steps["t_f"]).record()}
    assert rec.record()["t_f"] == m.record()["t_f"]  # the repetitions stay recorded


def _q(x: float) -> Quartiles:
    return Quartiles(median=x, q1=0.9 * x, q3=1.1 * x, mean=x)


@pytest.mark.parametrize("seed", range(10))
def test_pooling_scales_the_way_not_run_in_steps_as_the_steps_scaled_the_one_run(seed):
    """Each round ran one way of the first stage's W in its steps: the other way's repetitions
    are scaled pass by pass as that round's steps scaled its own, so that both ways are chosen
    between, and costed, alike."""
    rng = random.Random(seed)
    rounds, want = [], {False: [], True: []}
    for _ in range(rng.choice([2, 3, 5])):
        own = rng.random() < 0.5
        reps = {k: rng.uniform(0.5, 3.0) for k in ("t_f", "t_b", "t_w")}
        other = {k: rng.uniform(0.5, 3.0) for k in ("t_f", "t_b", "t_w")}
        scale = {k: rng.uniform(1.0, 1.3) for k in ("t_f", "t_b", "t_w")}
        cost = zb.StageCost(**{k: reps[k] * scale[k] for k in reps}, m_f=1.0, m_b=-0.5, m_w=-0.5, deferred_first=own)
        later = zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5)
        measured = {"stages": [
            {**{k: _q(reps[k]).model_dump() for k in reps}, "in_step": {k: _q(cost.model_dump()[k]).model_dump() for k in reps},
             "not_taken": {"w": "plain" if own else "deferred", **{k: _q(other[k]).model_dump() for k in other}}},
            {k: _q(1.0).model_dump() for k in reps}]}
        rounds.append(zb.Profile(name="r", memory_unit="bytes", stages=[cost, later], measured=measured))
        want[own].append([reps[k] * scale[k] for k in reps])
        want[not own].append([other[k] * scale[k] for k in reps])
    check_first_stage_way(pool_profiles(rounds), want)


# -- real steps on two ranks --------------------------------------------------------------------------


class _NoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _two_ranks(rank, world, send, kind):
    from zbsearch.profiler import Settings, as_model, builtin_gpt, profile_distributed

    torch.manual_seed(0)
    settings = Settings(warmup=1, repeat=3, rounds=1, threads=1, in_step=kind != "off")
    if kind == "no loss":
        spec = as_model(([_NoLoss(), _NoLoss()], torch.randn(4, 16)), "two layers")
        got = profile_distributed(spec, settings)
    elif kind == "v":
        spec = builtin_gpt(GPTConfig(**{**TINY.__dict__, "stages": 4}))
        got = profile_distributed(spec, settings, placement=placement(2, 2, "v"))
    else:
        spec = builtin_gpt(TINY)
        got = profile_distributed(spec, settings)
    return None if got is None else got.model_dump_json()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["looped", "v", "no loss", "off"])
def test_profiling_on_two_ranks_takes_the_pass_times_from_steps(kind):
    prof = zb.Profile.model_validate_json(run_local(_two_ranks, 2, kind, timeout=300)[0])
    assert prof.measured is not None
    if kind == "off":
        assert prof.t_action is None  # no steps ran: no host time per action measured
        assert "in_step" not in (prof.measured.model_extra or {})
        assert all(st.in_step is None for st in prof.measured.stages)
        return
    how = (prof.measured.model_extra or {})["in_step"]
    assert how["microbatches"] == 4 and how["steps"] >= 2
    assert how["orders"][0].startswith("zb-v" if kind == "v" else "1f1b")
    assert prof.t_action is not None and prof.t_action == pytest.approx(max(how["t_action"]["mean"], 0.0))
    for cost, spread in zip(prof.stages, prof.measured.stages):
        assert spread.in_step is not None and set(spread.in_step) == set(IN_STEP_KEYS)
        for key in IN_STEP_KEYS:
            reps, steps = getattr(spread, key), spread.in_step[key]
            # the repetitions' mean, scaled by the steps' median over the repetitions'
            assert getattr(cost, key) == pytest.approx(max(reps.mean, 1e-6) * steps.median / reps.median)
            assert getattr(spread, key) is not None  # the repetitions' times stay recorded
