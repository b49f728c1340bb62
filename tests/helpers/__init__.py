"""Helpers shared by the tests: small profiles, and the command line as a user runs it."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from zbsearch import Profile, StageCost

__all__ = ["make_profile", "run_cli", "cli_command", "check_first_stage_way"]


def make_profile(p, t_f=1.0, t_b=1.0, t_w=1.0, m_w=0.4, t_comm=0.0, name="unit", stages=None, keep=None):
    """A profile with memory in M_B units; ``stages`` overrides the per-stage (t_f, t_b, t_w);
    ``keep``: full recomputation offered, its pass as long as F, a checkpointed F keeping that."""
    times = stages or [(t_f, t_b, t_w)] * p

    def recompute(f: float) -> dict:
        return {} if keep is None else {"t_r": f, "m_fc": keep}

    return Profile(
        name=name,
        memory_unit="activations",
        stages=[StageCost(t_f=f, t_b=b, t_w=w, m_f=1.0, m_b=-(1.0 - m_w), m_w=-m_w, **recompute(f)) for f, b, w in times],
        t_comm=t_comm,
    )


def cli_command() -> list[str]:
    """The installed ``zbsearch`` entry point of this Python (``python -m zbsearch`` if absent)."""
    script = Path(sys.executable).parent / "zbsearch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "zbsearch"]


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    """Run ``zbsearch ARGS`` in a subprocess, capturing text output."""
    return subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True, **kw)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """Run ``zbsearch ARGS`` in this process (the real entry point): exit code, stdout, stderr."""
    from zbsearch.app.cli import main

    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def check_first_stage_way(pooled: Profile, want: dict[bool, list]) -> bool:
    """Check ``pool_profiles``'s first stage against ``want``: per way of its W (deferred or not)
    each round's (t_f, t_b, t_w) in that way. Each way pools to its per-pass medians, and the
    cheaper of the two is kept; returns that way."""
    medians = {d: [statistics.median(t[i] for t in want[d]) for i in range(3)] for d in (False, True)}
    best = min((False, True), key=lambda d: sum(medians[d]))
    st = pooled.stages[0]
    assert st.deferred_first is best, (st.deferred_first, medians)
    assert [st.t_f, st.t_b, st.t_w] == pytest.approx(medians[best]), medians
    return best
