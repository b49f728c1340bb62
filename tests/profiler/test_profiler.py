"""Profiler: structure of a measured profile, B+W against F, runtime agreement, bad input, torchrun."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.actions import Op
from zbsearch.distributed import PEER_TIMEOUT_S, run_local
from zbsearch.distributed import clock as device_clock
from zbsearch.errors import ZbError
from zbsearch.models import GPTConfig, gpt_batch
from zbsearch.profiler import (
    LinkModel,
    Settings,
    builtin_gpt,
    load_model,
    measure_stage,
    profile_distributed,
    profile_one_device,
    runtime_vs_profile,
)
from zbsearch.runtime import PipelineRuntime

TINY = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2, stages=2)
LINK = LinkModel(latency_ms=0.05, bandwidth_gb_s=1.0, how="fixed by the test")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cpu_clock(monkeypatch):
    """Passes timed by this thread's CPU time instead of the wall clock, in the profiler and in
    the runtime's trace alike: then what a pass costs does not depend on what else the machine
    runs, and the timing checks cannot be upset by a loaded machine. (Both read the runtime's
    ``DeviceClock``.)"""
    monkeypatch.setattr(device_clock, "time", types.SimpleNamespace(perf_counter=time.thread_time))


def test_tiny_gpt_profile_has_the_expected_structure(tmp_path):
    prof = profile_one_device(builtin_gpt(TINY), Settings(warmup=1, repeat=3), link=LINK)
    assert prof.memory_unit == "bytes" and prof.num_stages == 2
    extra = prof.model_dump()
    assert extra["torch"] == torch.__version__ and extra["dtype"] == "float32" and extra["device"].startswith("cpu")
    assert extra["settings"]["repeat"] == 3 and extra["model"]["layers"] == 2
    assert extra["links"]["method"] == "estimated"
    boundary = TINY.microbatch_size * TINY.seq * TINY.hidden * 4
    assert extra["measured"]["boundary_bytes"] == [boundary]
    assert prof.t_comm == [pytest.approx(LINK.time_ms(boundary))]
    for s, st in enumerate(prof.stages):
        assert st.t_f > 0 and st.t_b > 0 and st.t_w > 0 and st.t_ff is not None and st.t_ff > 0
        assert st.m_f > 0 and st.m_b <= 0 and st.m_w <= 0
        assert st.m_f + st.m_b + st.m_w == pytest.approx(0, abs=1e-6 * st.m_f)
        spread = extra["measured"]["stages"][s]["t_f"]
        assert spread["q1"] <= spread["median"] <= spread["q3"]
    assert 0 < -prof.stages[1].m_w < prof.stages[1].m_f  # B frees part, W the rest
    zb.save_profile(prof, tmp_path / "p.json")
    assert zb.load_profile(tmp_path / "p.json").model_dump() == prof.model_dump()


def test_rounds_are_pooled_into_the_profile():
    """Each round measures every stage; the profile's times are the medians over the rounds
    it records, so a moment when the machine was slower moves the profile by less."""
    prof = profile_one_device(builtin_gpt(TINY), Settings(warmup=1, repeat=3, rounds=3), link=LINK)
    rounds = prof.measured.rounds
    assert rounds["count"] == 3 and len(rounds["stages"]) == 3
    for s, st in enumerate(prof.stages):
        # a first stage's F, B and W are pooled per way its W can run, and rounds may have
        # taken different ways (tests/profiler/test_first_stage_w.py checks that pooling)
        ways = s == 0 and prof.measured.stages[0].not_taken is not None
        for k in ("t_bw", "t_ff") if ways else ("t_f", "t_b", "t_w", "t_bw", "t_ff"):
            assert getattr(st, k) == statistics.median(r[s][k] for r in rounds["stages"])
            assert rounds["drift"][s][k] >= 0
    once = profile_one_device(builtin_gpt(TINY), Settings(warmup=1, repeat=3, rounds=1), link=LINK)
    assert "rounds" not in once.measured.model_dump() and once.settings["rounds"] == 1
    with pytest.raises(ZbError, match="--rounds must be at least 1"):
        profile_one_device(builtin_gpt(TINY), Settings(rounds=0), link=LINK)


@pytest.mark.parametrize("timeout", [0.0, -5.0, float("nan"), float("inf")])
def test_peer_timeout_must_be_a_positive_number_of_seconds(timeout):
    with pytest.raises(ZbError, match="--timeout must be a positive number of seconds"):
        Settings(timeout=timeout).check()


def test_peer_timeout_defaults_to_the_shared_one_and_is_not_recorded():
    assert Settings().timeout == PEER_TIMEOUT_S
    Settings(timeout=0.5).check()
    assert "timeout" not in Settings(timeout=12.0).record()


def test_matmul_heavy_block_backward_is_about_twice_the_forward(cpu_clock):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    x = torch.randn(256, 256, requires_grad=True)
    m = measure_stage(block, (x,), None, torch.device("cpu"), warmup=2, repeat=5)
    ratio = (m.b.median + m.w.median) / m.f.median
    assert 1.0 < ratio < 4.0, ratio
    assert m.m_f > 0 and m.m_b <= 0 and m.m_f + m.m_b > 0  # W still holds its layers' inputs after B


def _runtime_traces(cfg: GPTConfig, spec, m: int, steps: int):
    """All stages on this one rank, in a V (F, B and W apart): the runtime times each pass."""
    one = zb.Profile(name="placeholder", memory_unit="activations",
                     stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)])
    sched = zb.build_classic("zb-v", one, m)
    runtime = PipelineRuntime(sched, dict(enumerate(spec.stages)), spec.loss_fn)
    ids, targets = gpt_batch(cfg, m)
    traces = []
    for step in range(steps + 1):
        runtime.step(ids, targets)
        if step:
            traces.append(runtime.trace())
    return traces


def test_runtime_per_pass_times_agree_with_the_profile(cpu_clock):
    """The same passes timed by the runtime and by the profiler agree within 50%; the best of
    three attempts counts, against the odd disturbance that CPU time still sees."""
    cfg = GPTConfig(layers=2, hidden=128, heads=2, seq=128, vocab=256, microbatch_size=2, stages=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        worst = []
        for _ in range(3):
            spec = builtin_gpt(cfg)
            prof = profile_one_device(spec, Settings(warmup=2, repeat=6), link=LINK)
            rows = runtime_vs_profile(prof, _runtime_traces(cfg, spec, m=4, steps=2))
            # every pass but the first stage's B, which does nothing (its whole backward is W's)
            assert {(r.stage, r.op) for r in rows} == {(s, op) for s in range(2) for op in (Op.F, Op.B, Op.W)} - {(0, Op.B)}
            assert prof.stages[0].t_b < 0.01 * prof.stages[0].t_w and prof.stages[0].m_b == 0
            worst.append(max(abs(r.error) for r in rows))
            if worst[-1] < 0.5:
                break
        assert min(worst) < 0.5, worst
    finally:
        dist.destroy_process_group()


# -- bad input ------------------------------------------------------------------------------------
USER_MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    def good():
        return [nn.Linear(8, 16), nn.Linear(16, 4)], torch.randn(4, 8)

    def with_loss():
        return [nn.Linear(8, 16), nn.Linear(16, 4)], torch.randn(4, 8), nn.functional.mse_loss, torch.zeros(4, 4)

    def mismatch():
        return [nn.Linear(8, 16), nn.Linear(8, 4)], torch.randn(4, 8)

    def one_thing():
        return [nn.Linear(8, 16)]

    def not_modules():
        return ["linear"], torch.randn(4, 8)

    def broken():
        raise ValueError("no weights on disk")
""")


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    (folder / "zb_user_models.py").write_text(USER_MODEL)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.mark.parametrize("fn", ["good", "with_loss"])
def test_user_model_is_profiled(user_models, fn):
    spec = load_model(f"zb_user_models:{fn}")
    prof = profile_one_device(spec, Settings(warmup=1, repeat=3), link=LINK, name=fn)
    assert prof.name == fn and prof.model_dump()["model"] == {"model": f"zb_user_models:{fn}"}
    assert prof.model_dump()["measured"]["boundary_bytes"] == [4 * 16 * 4]


@pytest.mark.parametrize(
    "path, words",
    [
        ("no_such_package.model:build", "cannot import 'no_such_package.model': ModuleNotFoundError"),
        ("zb_user_models", "expected an import path like mypkg.model:build_stages"),
        ("zb_user_models:missing", "has no function 'missing'"),
        ("zb_user_models:broken", "broken() raised ValueError: no weights on disk"),
        ("zb_user_models:one_thing", "returned a list of 1; expected (stages, microbatch)"),
        ("zb_user_models:not_modules", "stages must be a non-empty list of torch.nn.Module"),
    ],
)
def test_bad_model_functions_are_one_line_errors(user_models, path, words):
    with pytest.raises(ZbError) as err:
        load_model(path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_stages_that_do_not_fit_together_are_named(user_models):
    with pytest.raises(ZbError, match=r"stage 1 does not accept the outputs of stage 0 \(float32\(4, 16\)\): RuntimeError: mat1"):
        profile_one_device(load_model("zb_user_models:mismatch"), Settings(), link=LINK)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_requested_but_absent():
    with pytest.raises(ZbError, match="CUDA was requested but is not available"):
        profile_one_device(builtin_gpt(TINY), Settings(device="cuda"), link=LINK)


def _cli(*args, cwd, env=None):
    return subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=120)


def test_cli_reports_a_bad_model_in_one_line(user_models, tmp_path):
    r = _cli("profile", "--model", "zb_user_models:mismatch", cwd=tmp_path, env={"PYTHONPATH": str(user_models)})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "stage 1 does not accept" in r.stderr


# -- the command on one device, and under torchrun -----------------------------------------------------
_GPT_ARGS = ["--builtin", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
             "--stages", "2", "--warmup", "1", "--repeat", "3"]


@pytest.mark.slow
def test_cli_profile_on_one_device_writes_profiles_folder(tmp_path):
    r = _cli("profile", *_GPT_ARGS, "--threads", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    files = list((tmp_path / "profiles").iterdir())
    assert [f.name for f in files] == ["gpt-l2-h32-s16-b2-p2-cpu.json"]
    doc = json.loads(files[0].read_text())
    assert doc["mode"] == "one device, stage after stage" and doc["links"]["method"] == "estimated"
    assert doc["links"]["latency_ms"] > 0 and doc["links"]["bandwidth_gb_s"] > 0 and doc["settings"]["threads"] == 1
    for spread in doc["links"]["one_way_spread_ms"].values():  # the estimate's samples: the least is the latency
        assert 0 < spread["q1"] <= spread["median"] <= spread["q3"]
    assert doc["links"]["latency_ms"] <= doc["links"]["one_way_spread_ms"]["4 B"]["q1"]
    assert "T_B+T_W" in r.stdout


@pytest.mark.slow
def test_torchrun_profiles_one_stage_per_rank_into_one_file(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "zbsearch",
           "profile", *_GPT_ARGS, "--name", "tr", "-o", "tr.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [f.name for f in tmp_path.iterdir()] == ["tr.json"]
    prof = zb.load_profile(tmp_path / "tr.json")
    doc = prof.model_dump()
    assert prof.num_stages == 2 and doc["mode"].startswith("one rank per stage, 2 ranks")
    assert doc["links"]["method"] == "measured" and len(doc["links"]["devices"]) == 2 and prof.t_comm[0] > 0
    assert prof.t_send[0] > 0 and prof.t_recv[0] > 0


def _mismatched_ranks(rank: int, world: int, send) -> None:
    from zbsearch.profiler.stages import as_model

    spec = as_model(([nn.Linear(8, 16), nn.Linear(8, 4)], torch.randn(4, 8)), "test")
    profile_distributed(spec, Settings(warmup=1, repeat=3))


@pytest.mark.slow
def test_torchrun_mode_stops_every_rank_on_a_stage_mismatch():
    with pytest.raises(ZbError, match="stage 1 does not accept the outputs of stage 0"):
        run_local(_mismatched_ranks, 2, timeout=60)


# -- pieces for a placement (V: 2 pieces per rank) ---------------------------------------------------------
V4 = GPTConfig(**{**TINY.__dict__, "layers": 4, "stages": 4})
V_PLACEMENT = [0, 1, 1, 0]


def _pieces_on_two_ranks(rank: int, world: int, send):
    return profile_distributed(builtin_gpt(V4), Settings(warmup=1, repeat=3, threads=1), placement=V_PLACEMENT)


@pytest.mark.slow
def test_distributed_pieces_are_measured_by_the_rank_that_runs_them():
    """2 ranks (not one process per piece) measure the 4 pieces of a V: each piece on its real
    inputs (its memory is what the one-device profile of the same pieces measures, an
    independent chain), links timed only between the ranks, the local hand-over costs 0."""
    prof = run_local(_pieces_on_two_ranks, 2, timeout=120)[0]
    alone = profile_one_device(builtin_gpt(V4), Settings(warmup=1, repeat=3), link=LINK, placement=V_PLACEMENT)
    assert prof.placement == V_PLACEMENT == alone.placement and prof.num_ranks == 2 and prof.num_stages == 4
    assert [st.m_f for st in prof.stages] == [st.m_f for st in alone.stages]
    # piece 2 takes piece 1's output on the same rank: its B has an input gradient to compute
    # (only piece 0's B is empty), as on one device
    assert [st.m_b for st in prof.stages] == [st.m_b for st in alone.stages]
    assert prof.stages[0].m_b == 0 and all(st.m_b < 0 for st in prof.stages[1:])
    assert prof.measured.boundary_bytes == alone.measured.boundary_bytes
    doc = prof.model_dump()
    assert doc["mode"].startswith("2 pieces per rank, placement [0, 1, 1, 0], 2 ranks")
    assert len(doc["links"]["devices"]) == 2
    one_way = doc["links"]["one_way_ms"]
    assert one_way[1] is None and one_way[0]["median"] > 0 and one_way[2]["median"] > 0
    assert prof.t_comm[1] == 0 and prof.t_comm[0] == one_way[0]["mean"] and prof.t_comm[2] == one_way[2]["mean"]
    assert alone.t_comm[1] == 0 and alone.t_comm[0] == pytest.approx(LINK.time_ms(alone.measured.boundary_bytes[0]))
    # host time per message at each end of the two links between ranks, none for the hand-over
    for kind, values in (("send_ms", prof.t_send), ("recv_ms", prof.t_recv)):
        timed = doc["links"][kind]
        assert timed[1] is None and values[1] == 0
        assert values[0] == timed[0]["median"] > 0 and values[2] == timed[2]["median"] > 0
    # what schedules get from it: the pieces' own costs, plus the message time where they send
    # or receive across ranks (piece 0's F sends to rank 1, piece 3's F receives from it)
    cost, compute = zb.CostModel.from_profile(prof, V_PLACEMENT), zb.CostModel.from_profile(prof.compute_only(), V_PLACEMENT)
    assert compute.t_f == tuple(st.t_f for st in prof.stages) and cost.comm_next == tuple(prof.t_comm)
    assert cost.t_f[0] == pytest.approx(compute.t_f[0] + prof.t_send[0])
    assert cost.t_f[3] == pytest.approx(compute.t_f[3] + prof.t_recv[2])


def _ranks_per_machine(rank: int, world: int, send, per_machine: list[str]):
    os.environ["LOCAL_WORLD_SIZE"] = per_machine[rank]  # what torchrun tells each rank
    prof = profile_distributed(builtin_gpt(TINY), Settings(warmup=1, repeat=3, rounds=1, threads=1))
    return prof.mode if prof is not None else None


@pytest.mark.slow
@pytest.mark.parametrize(("per_machine", "in_turns"), [(["1", "1"], False), (["1", "4096"], True)])
def test_ranks_measure_at_once_only_where_every_machine_has_the_cores(per_machine, in_turns):
    """One rank alone on its machine, the other sharing a machine's cores with 4095 more: a
    rank that would time its neighbours' share of a core makes them all take turns (had each
    decided alone, one would wait at barriers the other never reaches)."""
    mode = run_local(_ranks_per_machine, 2, per_machine, timeout=120)[0]
    assert mode.startswith("one rank per stage, 2 ranks") and mode.endswith(", in turns") == in_turns


def _placement_for_three_ranks(rank: int, world: int, send):
    profile_distributed(builtin_gpt(GPTConfig(**{**V4.__dict__, "layers": 6, "stages": 6})), Settings(warmup=1, repeat=3),
                        placement=[0, 1, 2, 2, 1, 0])


@pytest.mark.slow
def test_distributed_pieces_need_one_process_per_rank_not_per_piece():
    with pytest.raises(ZbError, match="on 3 ranks but 2 ranks were started; start one rank per pipeline rank"):
        run_local(_placement_for_three_ranks, 2, timeout=60)


@pytest.mark.parametrize(("placement", "words"), [
    ([0, 0], "the placement has 2 entries for the model's 4 stages"),
    ([0, 1, 1, 1], "must give ranks 0..1 the same number of stages each"),
    ([0, 2, 2, 0], "must give ranks 0..2 the same number of stages each"),
])
def test_a_placement_is_checked_before_anything_is_timed(placement, words):
    with pytest.raises(ZbError, match=words):
        profile_one_device(builtin_gpt(V4), Settings(warmup=1, repeat=3), link=LINK, placement=placement)


@pytest.mark.slow
def test_torchrun_profiles_v_pieces_with_one_rank_per_pipeline_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "zbsearch",
           "profile", *_GPT_ARGS, "--layers", "4", "--stages", "4", "--placement", "v", "-o", "v.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = zb.load_profile(tmp_path / "v.json")
    assert prof.placement == V_PLACEMENT and prof.name.endswith("-cpu-v") and prof.t_comm[1] == 0 < prof.t_comm[0]
    assert prof.model_dump()["mode"].startswith("2 pieces per rank")
    wrong = subprocess.run([*cmd[:5], "4", *cmd[6:-1], "w.json"], capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert wrong.returncode != 0 and "start one rank per pipeline rank" in wrong.stderr
