"""Helpers shared by the tests: small profiles, and the command line as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zbsearch import Profile, StageCost

__all__ = ["make_profile", "run_cli", "cli_command"]


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
