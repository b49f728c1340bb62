"""profile --dp: each stage's gradient reduction and optimizer step in the profile, from the
stages' own parameters, so that solve then minimises the iteration."""

from __future__ import annotations

import json
import math
import random
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.models import GPTConfig, gpt_stages
from zbsearch.profiler.gradients import gradient_bytes, optimizer_step_ms
from zbsearch.solver import solve


def _profile(*extra: str) -> subprocess.CompletedProcess:
    """``zbsearch profile`` of a small built-in GPT on 2 stages, quickly, with ``extra`` options."""
    return subprocess.run([*cli_command(), "profile", "--builtin", "gpt", "--layers", "4", "--hidden", "64", "--seq", "32",
                           "-b", "2", "--stages", "2", "--repeat", "3", "--rounds", "1", "--warmup", "1", "--threads", "1",
                           *extra], capture_output=True, text=True)

def test_profile_with_replicas_prices_each_stages_all_reduce_and_step(tmp_path):
    out = tmp_path / "p.json"
    r = _profile("--dp", "8", "--dp-bandwidth", "10", "--dp-share", "0.5", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    # the share given for the priced reductions, in the record the profiler measures elsewhere
    assert {k: v for k, v in doc["data_parallel"]["sharing"].items() if v is not None} == {"version": 1, "share": 0.5}
    assert zb.CostModel.from_profile(zb.load_profile(out), [0, 1]).lane_share == 0.5
    # the stages' trainable parameters, counted here from the model itself (float32)
    stages = gpt_stages(GPTConfig(layers=4, hidden=64, heads=4, seq=32, microbatch_size=2, stages=2))
    want = [4.0 * sum(p.numel() for p in st.parameters() if p.requires_grad) for st in stages]
    assert doc["data_parallel"]["replicas"] == 8 and doc["data_parallel"]["grad_bytes"] == pytest.approx(want)
    for st, b in zip(doc["stages"], want):
        assert st["t_reduce"] == pytest.approx(2 * 7 / 8 * b / 10e9 * 1e3)
        assert st["t_opt"] > 0
    res = solve(zb.load_profile(out), 4, "2p", time_limit=1)
    assert res.info.objective == "iteration" and max(res.schedule.predicted.iteration) > max(res.schedule.predicted.span)


def test_a_tied_weight_counts_once_and_frozen_ones_not_at_all():
    import torch

    lin = torch.nn.Linear(8, 8)
    model = torch.nn.ModuleDict({"a": lin, "b": lin, "c": torch.nn.Linear(8, 2)})
    model["c"].weight.requires_grad_(False)
    assert gradient_bytes(model) == 4 * (64 + 8 + 2)
    assert gradient_bytes(model, torch.bfloat16) == 2 * (64 + 8 + 2)
    assert optimizer_step_ms(model, torch.device("cpu")) > 0
    assert optimizer_step_ms(torch.nn.ReLU(), torch.device("cpu")) == 0.0


def _reduce_twice(rank: int, world: int, send) -> tuple[list[list[float]], list[float], list[list[float]]]:
    import threading
    import time

    import torch

    from zbsearch.profiler.gradients import _Gradients, reduction_samples
    from zbsearch.profiler.slowdown import LANE_THREAD, reduction_buffers, slowdown_samples

    grads = _Gradients([((3, 2), torch.float32), ((5,), torch.float32)])
    for p in grads.params:
        p.grad.fill_(rank + 1.0)
    samples = reduction_samples([grads], None, repeat=3, timeout=60)

    def artificial() -> None:  # a pass that takes twice as long while a reduction runs beside it
        busy = any(t.name == LANE_THREAD and t.is_alive() for t in threading.enumerate())
        time.sleep(0.02 if busy else 0.01)

    bufs = reduction_buffers(grads, None, 60)
    slow = slowdown_samples([artificial, artificial], [bufs, []], None, repeat=4, warmup=1, timeout=60)
    return samples, [float(v) for p in grads.params for v in p.grad.unique()], slow


def test_reduction_samples_time_a_real_all_reduce_across_the_group_and_the_slowdown_beside_it():
    from zbsearch.distributed import run_local

    got = run_local(_reduce_twice, 2, timeout=120)
    for samples, values, slow in got:
        assert len(samples) == 1 and len(samples[0]) == 3 and min(samples[0]) > 0
        # 1 + 2 summed across the two ranks, then the sum summed again at each of the 3 more reductions
        assert values == [3.0 * 2**3] * 2  # each parameter's gradient, every element
        # the slowdown: the pass timed beside the reductions (zeros: the gradients above are untouched),
        # 20 ms against 10 ms alone, with the sleeps' jitter
        assert len(slow) == 2 and all(len(s.passes) == 4 for s in slow)  # each pass overlapped whole: none left out
        assert all(1.5 < f < 3.0 for s in slow for f in s.passes)
        # the same rounds time the reduction beside the pass: a few small reductions fit in each 20 ms pass
        assert all(len(s.lane) == 4 and min(s.lane) > 0 for s in slow)
    _record(got)


def _record(got) -> None:
    """The factors the two processes timed, recorded as a profile records them."""
    import statistics

    from zbsearch.profiler.gradients import with_measured_data_parallel

    pooled = [got[0][2][s].passes + got[1][2][s].passes for s in range(2)]
    base = zb.resolve_profile("unit-p4").model_copy(update={"stages": zb.resolve_profile("unit-p4").stages[:2]})
    prof = with_measured_data_parallel(base, 2, [[1.0, 2.0]] * 2, [1e6] * 2, [0.0] * 2, group="local", backend="gloo",
                                       slowdown=[pooled[0], []])
    assert prof.stages[0].reduce_slowdown == pytest.approx(statistics.median(pooled[0]))
    assert prof.data_parallel.slowdown[0].median == prof.stages[0].reduce_slowdown
    assert prof.stages[1].reduce_slowdown is None and prof.data_parallel.slowdown[1] is None  # no sample kept
    cost = zb.CostModel.from_profile(prof, [0, 1])
    assert cost.slowdown == (prof.stages[0].reduce_slowdown, 1.0)


def test_the_share_is_the_sharing_rule_inverted_and_is_recorded_in_the_profile(tmp_path):
    from zbsearch.profiler.gradients import lane_sharing, with_measured_data_parallel
    from zbsearch.reductions import share_rate

    rng = random.Random(3)
    for _ in range(50):
        share, k = rng.uniform(0.0, 2.0), rng.randint(2, 6)
        alone = [[rng.uniform(5, 50)] * 3 for _ in range(k)]
        together = [[a[0] / share_rate(k, share)] * 3 for a in alone]  # what the rule says k at once take
        got = lane_sharing(alone, together, [k] * k, None)
        assert got.share == pytest.approx(share) and got.measured.q1 <= got.measured.median <= got.measured.q3
    assert lane_sharing([[5.0, 5.0]], [[5.0, 5.0]], [1], None) is None  # nothing ran beside it: not measured
    assert lane_sharing([[10.0] * 3] * 2, [[8.0] * 3] * 2, [2, 2], 2).share == 0.0  # faster together: no sharing
    base = zb.resolve_profile("unit-p4")
    sharing = lane_sharing([[4.0, 5.0, 6.0]] * 4, [[8.0, 10.0, 12.0]] * 4, [4] * 4, 2)
    prof = with_measured_data_parallel(base, 2, [[5.0, 5.0]] * 4, [1e6] * 4, [0.0] * 4, group="torchrun", backend="gloo",
                                       sharing=sharing)
    zb.save_profile(prof, tmp_path / "s.json")
    back = zb.load_profile(tmp_path / "s.json")
    assert back.data_parallel.sharing == sharing and back.data_parallel.sharing.version == 1
    assert sharing.share == pytest.approx(1 / 3) and sharing.ranks_per_link == 2  # 2x the median alone at k = 4
    cost = zb.CostModel.from_profile(back, [0, 1, 2, 3])
    assert cost.lane_link == (0, 0, 1, 1) and cost.lane_share == pytest.approx(1 / 3)
    from zbsearch.profiler.report import mesh_summary

    assert any("each run at 1 / (1 + 0.333 (k - 1))" in line for line in mesh_summary(back))


def test_measured_reductions_are_recorded_with_their_spread_and_survive_a_file(tmp_path):
    from zbsearch.profiler.gradients import with_measured_data_parallel
    from zbsearch.profiler.report import mesh_summary

    base = zb.resolve_profile("unit-p4")
    samples = [[2.0, 1.0, 4.0], [3.0, 3.5, 2.5], [1.0, 1.0, 1.0], [8.0, 6.0, 7.0]]
    prof = with_measured_data_parallel(base, 4, samples, [1e6] * 4, [0.5] * 4, group="local", backend="gloo",
                                       slowdown=[[1.2, 1.4, 1.3], [0.9, 0.95, 1.0], [1.1], []],
                                       stretch=[[1.5, 1.7, 1.6], [0.8], [], [2.0, 2.2]])
    assert [st.t_reduce for st in prof.stages] == [2.0, 3.0, 1.0, 7.0]  # each stage's median
    # each stage's median factor, at least 1 (a pass measured faster beside the reduction: none); not measured: None
    assert [st.reduce_slowdown for st in prof.stages] == [pytest.approx(1.3), 1.0, pytest.approx(1.1), None]
    assert prof.data_parallel.slowdown[1].median == 0.95 and prof.data_parallel.slowdown[3] is None
    # the reduction's own slowdown beside the passes, likewise; carried into the costs (1 where not measured)
    assert [st.reduce_stretch for st in prof.stages] == [pytest.approx(1.6), 1.0, None, pytest.approx(2.1)]
    assert prof.data_parallel.stretch[1].median == 0.8 and prof.data_parallel.stretch[2] is None
    assert zb.CostModel.from_profile(prof, [0, 1, 2, 3]).stretch == pytest.approx((1.6, 1.0, 1.0, 2.1))
    assert "    and it runs 1-2.1 times slower beside them (reduce_stretch, 3 of 4 stages measured)" in mesh_summary(prof)
    assert "    passes beside it run 1-1.3 times slower (reduce_slowdown, 3 of 4 stages measured)" in mesh_summary(prof)
    assert [q.q1 for q in prof.data_parallel.reduce_ms] == [1.5, 2.75, 1.0, 6.5]
    assert prof.data_parallel.how == "measured" and prof.data_parallel.bandwidth_gbs is None
    zb.save_profile(prof, tmp_path / "p.json")
    assert zb.load_profile(tmp_path / "p.json") == prof
    one = with_measured_data_parallel(base, 1, [[]] * 4, [1e6] * 4, [0.0] * 4, group="local", backend="gloo")
    assert not one.has_reductions  # one replica reduces nothing
    old = json.loads((tmp_path / "p.json").read_text())  # a file written before these fields
    for k in ("group", "backend", "reduce_ms", "slowdown", "stretch"):
        del old["data_parallel"][k]
    for st in old["stages"]:
        del st["reduce_slowdown"], st["reduce_stretch"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = zb.load_profile(tmp_path / "old.json")
    assert older.data_parallel.reduce_ms is None and older.data_parallel.slowdown is None
    assert zb.CostModel.from_profile(older, [0, 1, 2, 3]).slowdown == ()  # old files: no slowdown
    assert older.data_parallel.stretch is None and zb.CostModel.from_profile(older, [0, 1, 2, 3]).stretch == ()
    assert older.data_parallel.sharing is None and zb.CostModel.from_profile(older, [0, 1, 2, 3]).lane_share == 0.0


@pytest.mark.slow
def test_profile_with_replicas_and_no_bandwidth_times_each_reduction_on_local_processes(tmp_path):
    out = tmp_path / "p.json"
    r = _profile("--dp", "2", "--name", "measured", "-o", str(out))
    assert r.returncode == 0, r.stderr
    prof = zb.load_profile(out)
    dp = prof.data_parallel
    stages = gpt_stages(GPTConfig(layers=4, hidden=64, heads=4, seq=32, microbatch_size=2, stages=2))
    want = [4.0 * sum(p.numel() for p in st.parameters() if p.requires_grad) for st in stages]
    assert prof.name == "measured" and dp.how == "measured" and dp.replicas == 2 and dp.group == "local"
    assert dp.backend == "gloo" and dp.bandwidth_gbs is None and dp.grad_bytes == pytest.approx(want)
    for st, q in zip(prof.stages, dp.reduce_ms):
        assert st.t_reduce == q.median > 0 and q.q1 <= q.median <= q.q3 and st.t_opt > 0
    # each stage's pass timed beside its reduction: a factor recorded with its spread, at least 1
    assert len(dp.slowdown) == 2
    for st, q in zip(prof.stages, dp.slowdown):
        assert st.reduce_slowdown == max(1.0, q.median) and q.q1 <= q.median <= q.q3 and q.median > 0
    # and, in the same rounds, its reduction beside its pass: likewise where a pass held a whole reduction
    assert len(dp.stretch) == 2
    for st, q in zip(prof.stages, dp.stretch):
        assert (st.reduce_stretch, q) == (None, None) or st.reduce_stretch == max(1.0, q.median) > 0
    # both stages' reductions timed alone and at once (4 processes): how they share this host's cores
    share = dp.sharing
    assert share is not None and share.ranks_per_link is None and len(share.alone_ms) == len(share.together_ms) == 2
    assert share.share == max(0.0, share.measured.median) and share.measured.q1 <= share.measured.median <= share.measured.q3
    assert all(q.median > 0 for q in (*share.alone_ms, *share.together_ms))
    assert zb.load_profile(out) == zb.Profile.model_validate_json(out.read_text())  # the fields round-trip
    back = tmp_path / "back.json"
    zb.save_profile(prof, back)
    assert zb.load_profile(back) == prof
    res = solve(prof, 4, "2p", time_limit=1)
    assert res.info.objective == "iteration" and max(res.schedule.predicted.iteration) > max(res.schedule.predicted.span)


@pytest.mark.slow
def test_torchrun_times_each_stages_reduction_on_the_replicas_started_with_the_pipeline(tmp_path):
    import sys

    args = ["profile", "--builtin", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
            "--stages", "2", "--warmup", "1", "--repeat", "3", "--rounds", "1", "--dp", "2"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    r = subprocess.run([*run, "4", "-m", "zbsearch", *args, "-o", "tr.json"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = zb.load_profile(tmp_path / "tr.json")
    dp = prof.data_parallel
    assert dp.how == "measured" and dp.group == "torchrun" and dp.backend == "gloo" and dp.replicas == 2
    assert len(dp.reduce_ms) == 2 and all(st.t_reduce == q.median > 0 for st, q in zip(prof.stages, dp.reduce_ms))
    assert len(dp.slowdown) == 2 and all(st.reduce_slowdown == max(1.0, q.median) for st, q in zip(prof.stages, dp.slowdown))
    assert len(dp.stretch) == 2 and all((st.reduce_stretch, q) == (None, None) or st.reduce_stretch == max(1.0, q.median)
                                        for st, q in zip(prof.stages, dp.stretch))
    # the reductions alone are t_reduce; every rank's at once against them, the share (one node: one link)
    assert dp.sharing is not None and dp.sharing.ranks_per_link is None and len(dp.sharing.together_ms) == 2
    assert [q.median for q in dp.sharing.alone_ms] == [q.median for q in dp.reduce_ms]
    assert prof.model_dump()["mode"].startswith("one rank per stage, 2 ranks")  # each replica's pipeline of 2
    wrong = subprocess.run([*run, "2", "-m", "zbsearch", *args, "-o", "w.json"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
    assert wrong.returncode != 0 and "start 2 pipeline ranks x 2 replicas = 4 processes" in wrong.stderr


# ---- sharded stages: each one's gather at the step's start and its reduce-scatter --------------

def _check_measured_sharing(share, stages: int) -> None:
    """A measured ``LaneSharing`` of one link holding every rank: each stage's runs alone and
    together, and the share their rounds' median, at least 0."""
    assert share is not None and share.ranks_per_link is None
    assert len(share.alone_ms) == len(share.together_ms) == stages
    assert share.share == max(0.0, share.measured.median) and share.measured.q1 <= share.measured.median <= share.measured.q3
    assert all(q.median > 0 for q in (*share.alone_ms, *share.together_ms))


_UNITS = [[((6, 4), "float32"), ((4,), "float32")], [((5, 3), "float32")]]


def _shard_twice(rank: int, world: int, send) -> tuple[list[tuple[list[float], list[float]]], list[list[float]]]:
    import threading
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from zbsearch.profiler.gradients import sharded_samples
    from zbsearch.profiler.slowdown import LANE_THREAD, sharded_buffers, slowdown_samples

    units = [[(shape, getattr(torch, dtype)) for shape, dtype in unit] for unit in _UNITS]
    both = sharded_samples([units, units[1:]], init_device_mesh("cpu", (world,)), repeat=3)

    def artificial() -> None:  # a pass that takes twice as long while the lane runs beside it
        busy = any(t.name == LANE_THREAD and t.is_alive() for t in threading.enumerate())
        time.sleep(0.02 if busy else 0.01)

    bufs = [sharded_buffers(units, world, torch.device("cpu")), sharded_buffers(units[1:], world, torch.device("cpu"))]
    slow = slowdown_samples([artificial, artificial], bufs, None, repeat=4, warmup=1, timeout=60, sharded=True)
    return both, slow


def test_sharded_samples_time_fsdps_gather_and_reduce_scatter_and_the_slowdown_beside_them():
    import statistics

    import torch

    from zbsearch.distributed import run_local
    from zbsearch.profiler.gradients import with_measured_data_parallel
    from zbsearch.profiler.slowdown import sharded_buffers

    got = run_local(_shard_twice, 2, timeout=180)
    for per_stage, slow in got:
        assert len(per_stage) == 2
        for gathers, reductions in per_stage:
            assert len(gathers) == len(reductions) == 3 and min(gathers) > 0 and min(reductions) > 0
        # the lane (each unit all-gathered, then reduce-scattered, on the real group) ran for each whole pass
        # (each factor 2 but for the sleeps' jitter on a loaded machine: the median of each stage's)
        assert len(slow) == 2 and all(len(s.passes) == 4 for s in slow)
        assert all(1.5 < statistics.median(s.passes) < 3.0 for s in slow)
    # the factors recorded as a sharded profile records them: each stage's median, beside its gathers
    pooled = [got[0][1][s].passes + got[1][1][s].passes for s in range(2)]
    base = zb.resolve_profile("unit-p4").model_copy(update={"stages": zb.resolve_profile("unit-p4").stages[:2]})
    prof = with_measured_data_parallel(base, 2, [r for _, r in got[0][0]], [1e6] * 2, [0.0] * 2, group="local",
                                       backend="gloo", gathers=[g for g, _ in got[0][0]], slowdown=pooled)
    assert prof.data_parallel.sharded and all(st.t_gather > 0 for st in prof.stages)
    assert [st.reduce_slowdown for st in prof.stages] == pytest.approx([statistics.median(f) for f in pooled])
    # what FSDP pads: each parameter's first dimension to a multiple of the ranks, per unit, 4 bytes each
    f32 = torch.float32
    sizes = [b.numel() for b in sharded_buffers([[((6, 4), f32), ((4,), f32)], [((5, 3), f32)]], 4, torch.device("cpu"))]
    assert sizes == [4 * (2 * 4 + 1), 4 * (2 * 3)]
    assert [b.numel() for b in sharded_buffers([[((6, 4), f32), ((3,), torch.bfloat16)]], 2, torch.device("cpu"))] == [24, 4]


def test_a_stages_units_are_those_shard_stage_shards():
    import torch

    from zbsearch.profiler.gradients import shard_units

    stage = gpt_stages(GPTConfig(layers=4, hidden=64, heads=4, seq=32, microbatch_size=2, stages=2))[0]
    units = shard_units(stage)
    holders = [c for c in stage.children() if any(True for _ in c.parameters())]
    assert len(units) == len(holders)  # one unit per child holding parameters: the stage root holds none of its own
    assert sum(math.prod(s) * d.itemsize for u in units for s, d in u) == gradient_bytes(stage)
    lin = torch.nn.Linear(8, 8)
    tied = torch.nn.ModuleDict({"a": lin, "b": lin})
    tied.register_parameter("own", torch.nn.Parameter(torch.zeros(3)))
    assert shard_units(tied) == [[((8, 8), torch.float32), ((8,), torch.float32)], [((3,), torch.float32)]]


def test_measured_gathers_are_recorded_and_the_simulator_waits_for_them(tmp_path):
    from zbsearch.profiler.gradients import with_measured_data_parallel

    base = zb.resolve_profile("unit-p4")
    reductions = [[2.0, 1.0, 4.0]] * 4
    gathers = [[3.0, 5.0, 4.0], [1.0, 1.0, 1.5], [0.5, 1.0, 0.5], [2.0, 2.5, 1.5]]
    prof = with_measured_data_parallel(base, 4, reductions, [1e6] * 4, [0.0] * 4, group="local", backend="gloo",
                                       gathers=gathers)
    dp = prof.data_parallel
    assert dp.sharded and [st.t_gather for st in prof.stages] == [4.0, 1.0, 0.5, 2.0]  # each stage's median
    assert [q.q3 for q in dp.gather_ms] == [4.5, 1.25, 0.75, 2.25]
    zb.save_profile(prof, tmp_path / "p.json")
    assert zb.load_profile(tmp_path / "p.json") == prof
    old = json.loads((tmp_path / "p.json").read_text())  # a file written before gathers were timed
    del old["data_parallel"]["gather_ms"]
    for st in old["stages"]:
        del st["t_gather"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    back = zb.load_profile(tmp_path / "old.json")
    assert back.data_parallel.gather_ms is None and all(st.t_gather is None for st in back.stages)
    # simulate: rank 0's first pass waits for its 4 ms gather and so does every pass after it (1F1B);
    # the other ranks' inputs come after their own gathers, which their steps start with: each
    # rank's iteration grows by its own stage's gather
    sched = zb.build_classic("1f1b", prof, 8)
    plain = zb.build_classic("1f1b", back, 8)
    tl, tl0 = zb.timeline(sched), zb.timeline(plain)
    assert tl.start[0][0] == 4.0 and tl.gathers[0] == [(0, 0.0, 4.0)]
    assert tl.iteration == pytest.approx([x + g for x, g in zip(tl0.iteration, [4.0, 1.0, 0.5, 2.0])])
    zb.save_schedule(sched, tmp_path / "s.json")
    r = subprocess.run([*cli_command(), "simulate", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert r.returncode == 0 and f"iteration {tl.period:.6g}"[:13] in " ".join(r.stdout.split())


@pytest.mark.slow
def test_profile_with_sharded_replicas_times_each_gather_on_local_processes(tmp_path):
    out = tmp_path / "p.json"
    r = _profile("--dp", "2", "--shard", "-o", str(out))
    assert r.returncode == 0, r.stderr
    prof = zb.load_profile(out)
    dp = prof.data_parallel
    assert dp.how == "measured" and dp.sharded and dp.group == "local" and len(dp.gather_ms) == 2
    for st, q, g in zip(prof.stages, dp.reduce_ms, dp.gather_ms):
        assert st.t_reduce == q.median > 0 and st.t_gather == g.median > 0 and g.q1 <= g.median <= g.q3
    # each stage's pass timed beside its gathers and reduce-scatters: a factor recorded with its spread
    assert len(dp.slowdown) == 2
    for st, q in zip(prof.stages, dp.slowdown):
        assert st.reduce_slowdown == max(1.0, q.median) and q.q1 <= q.median <= q.q3
    # both stages' reduce-scatters timed alone and at once (4 processes): how they share this host's cores
    _check_measured_sharing(dp.sharing, 2)
    res = solve(prof, 4, "2p", time_limit=1)
    tl = zb.timeline(res.schedule)
    assert tl.gathers and tl.start[0][0] >= prof.stages[0].t_gather  # the first pass waits for its gather
    assert _profile("--shard").returncode != 0


@pytest.mark.slow
def test_torchrun_times_each_sharded_stages_gather_on_the_replicas(tmp_path):
    import sys

    args = ["profile", "--builtin", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
            "--stages", "2", "--warmup", "1", "--repeat", "3", "--rounds", "1", "--dp", "2", "--shard"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    r = subprocess.run([*run, "-m", "zbsearch", *args, "-o", "tr.json"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = zb.load_profile(tmp_path / "tr.json")
    dp = prof.data_parallel
    assert dp.group == "torchrun" and dp.sharded and len(dp.gather_ms) == 2
    assert all(st.t_gather == q.median > 0 for st, q in zip(prof.stages, dp.gather_ms))
    assert len(dp.slowdown) == 2 and all(st.reduce_slowdown == max(1.0, q.median) for st, q in zip(prof.stages, dp.slowdown))
    # each rank's reduce-scatters alone are t_reduce; every rank's at once against them, the share
    _check_measured_sharing(dp.sharing, 2)
    assert [q.median for q in dp.sharing.alone_ms] == [q.median for q in dp.reduce_ms]


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.floats(0.1, 5.0), min_size=1, max_size=8), hs.floats(0.1, 5.0), hs.floats(0.1, 5.0),
       hs.floats(-1.0, 3.0), hs.floats(0.0, 20.0))
def test_the_stretch_is_the_reductions_within_the_pass_over_the_one_timed_alone(later, first, alone, lead, length):
    """A round's lane: two reductions alone (``ALONE``), then more; a pass from t0 (``lead`` after
    the second alone one ends, negative: before it) for ``length``. The factor is the mean of the
    later reductions that start and end within the pass over the second alone one, else None."""
    from zbsearch.profiler.slowdown import ALONE, _Lane

    lane = _Lane([], None)
    marks = [0.0, first, first + alone]
    for d in later:
        marks.append(marks[-1] + d)
    lane.marks = marks
    t0 = first + alone + lead
    t1 = t0 + length
    inside = [b - a for a, b in zip(marks[ALONE:], marks[ALONE + 1:]) if a >= t0 and b <= t1]
    want = None if marks[ALONE] > t0 or not inside else sum(inside) / len(inside) / alone
    got = lane.stretch(t0, t1)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(want)
