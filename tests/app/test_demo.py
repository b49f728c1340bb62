"""The demo end to end on local processes, in a fast configuration."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import cli_command
from zbsearch.app import demo
from zbsearch.app.demo import DemoConfig, contention_note, run_demo, should_emulate
from zbsearch.models import GPTConfig

TINY = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2, stages=2)


@pytest.mark.slow
def test_demo_profiles_solves_replays_and_compares(tmp_path):
    seen = []
    run = run_demo(DemoConfig(gpt=TINY, microbatches=4, steps=1, time_limit=1.0, warmup=1, repeat=3, out=tmp_path),
                   lambda what, done, total: seen.append(what))
    # the solver's schedule: zero-bubble, fused or mixed, or a classic kind, whichever is shortest
    solved = run.schedules[1].kind
    assert run.schedules[0].kind == "1f1b" and run.schedules[1].solver is not None
    assert run.profile.num_stages == 2 and run.profile.memory_unit == "bytes"
    for sched, trace, measured in zip(run.schedules, run.traces, run.measured):
        assert sorted(e.name for e in trace.traceEvents) == sorted(a for row in sched.actions for a in row)
        assert measured > 0 and max(sched.predicted.span) > 0
    name = solved if solved != "1f1b" else "1f1b-solved"
    assert {f.name for f in tmp_path.iterdir()} == {
        "profile.json", "1f1b.json", "1f1b-trace.json", f"{name}.json", f"{name}-trace.json", "gantt.png"}
    assert any(w.startswith("profiling") for w in seen) and any(w.startswith(f"replaying {solved}") for w in seen)


@pytest.mark.slow
def test_demo_command_with_emulated_stages(tmp_path):
    args = ["demo", "--stages", "2", "-m", "4", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
            "--emulate", "--steps", "1", "-t", "1", "-o", tmp_path / "out"]
    r = subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"speed-up of \S+ over 1F1B: predicted", r.stdout)
    assert "replay: emulated passes (each stage sleeps its profiled F, B, W and BW times)" in " ".join(r.stdout.split())
    assert (tmp_path / "out" / "gantt.png").stat().st_size > 0


@pytest.mark.slow
def test_demo_with_replicas_replays_in_a_mesh_both_ways(tmp_path):
    args = ["demo", "--dp", "2", "-m", "4", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
            "--steps", "1", "-t", "1", "-o", tmp_path / "out"]
    r = subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = " ".join(r.stdout.split())
    assert "p=2 x dp=2, m=4" in text and "gradient reductions included" in text
    assert re.search(r"speed-up of \S+ over 1F1B with the reductions: [0-9.]+x reduced after the step, [0-9.]+x overlapped", text)
    assert "4 ranks share" in text or "CPU cores for 4 ranks" in text  # the mesh's processes, not the pipeline's


@pytest.mark.parametrize(
    ("cores", "stages", "emulate", "load", "expected"),
    [
        (2, 4, True, 0.5, "replay: emulated passes (each stage sleeps its profiled F, B, W and BW times): "
                          "4 ranks share 2 CPU cores (--real runs the real passes, which then also wait for a core)"),
        (8, 4, True, 0.5, "replay: emulated passes (each stage sleeps its profiled F, B, W and BW times): as asked (--emulate)"),
        (2, 4, False, 0.5, "replay: real passes, as asked (--real); 4 ranks share 2 CPU cores, so measured times include "
                           "waiting for a core; --emulate replays the profiled times without that contention"),
        (8, 4, False, 0.5, "replay: real passes (8 CPU cores for 4 ranks)"),
        (8, 4, False, 9.5, "replay: real passes (8 CPU cores for 4 ranks); the machine is busy (load average 9.5), "
                           "so measured times include waiting for a core"),
    ],
)
def test_the_replay_says_whether_it_was_real_or_emulated_and_why(monkeypatch, cores, stages, emulate, load, expected):
    monkeypatch.setattr(demo, "cpu_cores", lambda: cores)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert should_emulate(stages, "cpu") == (cores < stages) and not should_emulate(stages, "cuda")
    gpt = GPTConfig(**{**TINY.__dict__, "stages": stages, "layers": stages})
    assert contention_note(DemoConfig(gpt=gpt, emulate=emulate)) == expected
