"""The ``run.sh`` files ``zbsearch tune -o`` writes start the example trainer and finish steps
on a pipeline x data-parallel mesh of 4 local processes; each baseline's files beside the
winner's hold its configuration as costed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import zbsearch as zb
from tests.helpers import run_main
from zbsearch.formats.layers import save_layers
from zbsearch.planner import llama_layers
from zbsearch.tuner import load_tune
from zbsearch.tuner.launch import Launch, baseline_folder

ROOT = Path(__file__).resolve().parents[2]
GPT = {"model": "builtin gpt", "layers": 4, "hidden": 32, "heads": 2, "seq": 16, "vocab": 64}


def _tuned(tmp_path, capsys) -> Path:
    """``tune -o`` for 4 ranks on per-layer profiles of a tiny built-in GPT (costs generated)."""
    paths = []
    for b in (1, 2):
        prof = llama_layers(4, 256, 2000, heads=4, seq=128, microbatch_size=b, tflops=20.0 + 5 * b, recompute=False,
                            bandwidth_gb_s=5.0, name=f"tiny-b{b}")
        path = tmp_path / f"tiny-b{b}.json"
        save_layers(prof.model_copy(update={"model": {**GPT, "microbatch_size": b}}), path)
        paths += ["-l", path]
    out = tmp_path / "tuned"
    code, _, err = run_main(capsys, "tune", *paths, "-r", "4", "--ranks-per-node", "4", "-g", "8", "--intra-gbs", "50",
                            "-t", "6", "--plan-time", "0.3", "-o", out)
    assert code == 0, err
    return out


def _mesh_launch(out: Path) -> tuple[Path, Launch]:
    """The first written configuration that is a pipeline of several stages in several replicas."""
    res = load_tune(out / "tune.json")
    folders = [out] + [out / "baselines" / baseline_folder(n) for n in sorted({r.source for r in res.rows} - {"tune"})]
    for folder in folders:
        if (folder / "launch.json").is_file():
            launch = Launch.model_validate_json((folder / "launch.json").read_text())
            if launch.pp > 1 and launch.dp > 1:
                return folder, launch
    raise AssertionError("tune wrote no pipeline x data-parallel configuration for 4 ranks")


def _run(folder: Path, command: str, *extra: str) -> list[float]:
    """Run a written ``run.sh`` from the checkout, ``extra`` passed on to the trainer; the losses
    its steps printed."""
    args = shlex.split(command)
    assert args[:3] == ["torchrun", "--nproc-per-node", "4"] and args[3] == "examples/train_gpt.py"
    assert f'{command} "$@"' in (folder / "run.sh").read_text().splitlines()
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # this Python's torchrun
    r = subprocess.run(["sh", str(folder / "run.sh"), *extra], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": path,
                            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]
    return [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step ")]


def test_tune_writes_a_baselines_launch_beside_the_winners_and_it_runs(tmp_path, capsys):
    out = _tuned(tmp_path, capsys)
    res = load_tune(out / "tune.json")
    families = {r.source for r in res.rows if r.source != "tune" and r.status == "costed"}
    assert "torchtitan 1F1B" in families
    for name in families:  # the best of each baseline, its schedule costed as its row says
        folder = out / "baselines" / baseline_folder(name)
        row = min((r for r in res.rows if r.source == name and r.status == "costed"), key=lambda r: r.iteration_ms)
        launch = Launch.model_validate_json((folder / "launch.json").read_text())
        sched = zb.load_schedule(folder / "schedule.json")
        zb.validate(sched)
        assert max(sched.predicted.iteration) == pytest.approx(row.iteration_ms)
        assert (launch.pp, launch.dp, launch.microbatch_size, launch.microbatches) == (
            row.pp, row.dp, row.microbatch_size, row.microbatches)
        assert sched.num_ranks == row.pp and sched.num_microbatches == row.microbatches
        assert f"--layers-per-stage {','.join(map(str, row.layers_per_stage))}" in launch.commands[0]
        if name.startswith("torchtitan"):  # torchtitan's own default at the mesh, to run it there
            args = (folder / "torchtitan" / "args.txt").read_text().split()
            assert args[args.index("--parallelism.pipeline_parallel_degree") + 1] == str(row.pp)
            assert args[args.index("--parallelism.data_parallel_replicate_degree") + 1] == str(row.dp)
            assert args[args.index("--training.local_batch_size") + 1] == str(row.microbatch_size * row.microbatches)
    folder, launch = _mesh_launch(out)
    losses = _run(folder, launch.commands[0], "--steps", "1")
    assert len(losses) == 1 and losses[0] > 0  # replica 0's last stage printed its step


@pytest.mark.slow  # torchrun starts 4 more processes
def test_a_written_launch_runs_emulated(tmp_path, capsys):
    out = _tuned(tmp_path, capsys)
    folder, launch = _mesh_launch(out)
    losses = _run(folder, launch.commands[0], "--steps", "2", "--emulate")
    assert len(losses) == 2
