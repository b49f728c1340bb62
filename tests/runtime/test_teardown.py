"""Clean exits and one-line errors when the process group's store or a peer goes away, with
ranks launched as env:// launchers do (rank 0 hosts the store, as under srun or mpirun)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT), TORCH_CPP_LOG_LEVEL="ERROR", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.helpers.env_ranks", scenario], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_runs_with_a_tied_weight_across_ranks_exit_cleanly():
    for _ in range(2):
        for rank, r in enumerate(_launch("tied")):
            assert r.returncode == 0, (rank, r.stderr)
            assert "terminate" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("scenario,words", [
    ("die-in-step", "the store is unreachable"),
    ("die-before-group", "post-validation group"),
])
def test_the_survivor_of_the_store_hosts_death_fails_in_one_line(scenario, words):
    dead, survivor = _launch(scenario)
    assert dead.returncode == 3
    assert survivor.returncode == 1
    lines = survivor.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 1: error: "), survivor.stderr
    assert words in lines[0]
