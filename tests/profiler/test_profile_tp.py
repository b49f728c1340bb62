"""profile --tp: each stage measured split over its tensor-parallel ranks (gloo), per rank, and
the mesh it was measured in recorded in the profile."""

from __future__ import annotations

import subprocess
import sys

import pytest

import zbsearch as zb
from tests.helpers import cli_command, run_main
from zbsearch.formats.mesh import ProfileMesh
from zbsearch.models import GPTConfig, gpt_stages
from zbsearch.profiler.gradients import gradient_bytes

_SIZE = dict(layers=2, hidden=32, heads=2, seq=16, microbatch_size=2, stages=2)
_ARGS = ["--builtin", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2", "--stages", "2",
         "--warmup", "1", "--repeat", "3", "--rounds", "1"]


def _profile(tmp_path, name: str, *extra: str) -> zb.Profile:
    r = subprocess.run([*cli_command(), "profile", *_ARGS, "--threads", "1", *extra, "-o", str(tmp_path / name)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return zb.load_profile(tmp_path / name)


@pytest.mark.slow
def test_a_profile_at_tp_2_is_per_rank_and_says_its_mesh(tmp_path):
    whole = _profile(tmp_path, "tp1.json")
    split = _profile(tmp_path, "tp2.json", "--tp", "2", "--dp", "2")
    assert whole.mesh == ProfileMesh(pp=2)  # written, at tp 1
    mesh = split.mesh
    assert (mesh.pp, mesh.dp_replicate, mesh.dp_shard, mesh.tp) == (2, 2, 1, 2) and "tensor-parallel" in split.mode
    # the all-reduce carries one microbatch's hidden state: batch x seq x hidden float32
    assert mesh.tp_link.bytes == 2 * 16 * 32 * 4 == split.measured.boundary_bytes[0]
    q = mesh.tp_link.all_reduce_ms
    assert 0 < q.q1 <= q.median <= q.q3 and mesh.tp_link.group == "local"
    assert split.model["identity"] == whole.model["identity"]  # the same model, the same cut
    stages = gpt_stages(GPTConfig(**_SIZE))
    for s, (one, two) in enumerate(zip(whole.stages, split.stages)):
        # each rank keeps its share of the split layers' activations and the whole of the rest
        assert 0.4 * one.m_f < two.m_f < one.m_f, (s, one.m_f, two.m_f)
        assert two.t_f > 0 and two.t_b > 0 and two.m_f + two.m_b + two.m_w == pytest.approx(0, abs=1e-6 * one.m_f)
        # each rank reduces the gradients of its shards: the split Linears' halves, norms and positions whole
        full = gradient_bytes(stages[s])
        assert 0.5 * full < split.data_parallel.grad_bytes[s] < full
        assert two.t_reduce == split.data_parallel.reduce_ms[s].median > 0
    sched = zb.solve(split, 4, "2p", time_limit=1).schedule
    assert sched.profile.made_for.tp == 2
    shown = subprocess.run([*cli_command(), "show", str(_save(sched, tmp_path)), "--width", "100"], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0 and "mesh pp 2 x dp_replicate 2 x tp 2" in shown.stdout.splitlines()[0]


def _save(sched: zb.Schedule, tmp_path):
    path = tmp_path / "s.json"
    zb.save_schedule(sched, path)
    return path


@pytest.mark.slow
def test_torchrun_measures_each_stage_split_over_the_ranks_started_with_the_pipeline(tmp_path):
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    args = ["-m", "zbsearch", "profile", *_ARGS, "--tp", "2"]
    r = subprocess.run([*run, "4", *args, "-o", "tr.json"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = zb.load_profile(tmp_path / "tr.json")
    assert (prof.mesh.pp, prof.mesh.tp, prof.mesh.tp_link.group, prof.mesh.tp_link.backend) == (2, 2, "torchrun", "gloo")
    assert prof.mode.endswith("each stage split over 2 tensor-parallel ranks") and prof.mesh.tp_link.bytes == 2 * 16 * 32 * 4
    wrong = subprocess.run([*run, "2", *args, "-o", "w.json"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert wrong.returncode != 0 and "start 2 pipeline ranks x 2 tensor-parallel ranks = 4 processes, not 2" in wrong.stderr
    assert not (tmp_path / "w.json").exists()
    odd = subprocess.run([*cli_command(), "profile", *_ARGS, "--tp", "3", "-o", "x.json"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)  # 2 heads do not split over 3 ranks
    assert odd.returncode != 0 and odd.stderr.startswith("error: tensor parallelism over 3 ranks: ")
    assert "Traceback" not in odd.stderr
    assert len(odd.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()


def test_bad_tensor_parallel_options_are_refused_in_one_line(tmp_path, capsys):
    for extra, why in ((["--tp", "2", "--per-layer"], "--tp applies to stage profiles"),
                       (["--sequence-parallel"], "--sequence-parallel splits the sequence over the tensor-parallel ranks"),
                       (["--tp", "2", "--dp", "2", "--dp-bandwidth", "10"], "--dp-bandwidth prices whole stages' gradients")):
        code, _, err = run_main(capsys, "profile", *_ARGS, *extra, "-o", str(tmp_path / "x.json"))
        assert code != 0 and why in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()
