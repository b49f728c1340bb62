"""The work clock (``zbsearch.clock``, ``--deterministic``): time limits counted in work give
the same solve, plan and tune on the same inputs however loaded the machine is.

Each case runs twice, the second time beside a process spinning on the CPU, so that the wall
clock of the two runs differs; the results (their JSON, the time they report included) must be
identical. The instances are generated, and large enough that the limit binds: some part of the
search stops at its share of the limit (checked, so that the comparison is not between two
runs that finished their search anyway).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.helpers import run_main
from tests.helpers.reference import random_profile
from zbsearch import clock
from zbsearch.planner import llama_layers, plan
from zbsearch.solver import solve
from zbsearch.tuner import Cluster, tune


@contextlib.contextmanager
def cpu_burner() -> Iterator[None]:
    """A process spinning on the CPU for the block's length."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def twice(run, *args, **kw):
    """``run(*args, **kw)`` alone, then beside a CPU burner."""
    first = run(*args, **kw)
    with cpu_burner():
        second = run(*args, **kw)
    return first, second


def test_the_work_clock_counts_work_nests_and_ends():
    assert clock.kind() == "wall" and not clock.counting()
    assert clock.highs_limits(1.0, 1000) == (1.0, None)
    clock.simulated(10**9)  # nothing on the wall clock
    with clock.work_clock():
        assert clock.kind() == "work"
        a = clock.now()
        clock.simulated(500_000)
        clock.highs_spent(10, 1000, 100)
        clock.spend(0.25)
        b = clock.now()
        rates = clock.WORK_RATES
        assert b - a == pytest.approx(5e5 / rates.passes + 1 / rates.models + 1000 / rates.looks + 1e5 / rates.iterations + 0.25
                                      + 1 / rates.reads)
        with clock.work_clock():  # an inner block goes on counting
            assert clock.now() > b
        assert clock.counting()
        (wall, one), (_, two), (_, big) = (clock.highs_limits(s, n) for s, n in ((1.0, 100), (2.0, 100), (1.0, 10**4)))
        assert wall == float("inf") and one is not None and two is not None and big is not None
        assert 1 <= big < one < two  # more time, more looks; a larger model, fewer
    assert not clock.counting()
    with clock.work_clock():
        assert clock.now() < b  # a new block counts from zero


def test_solves_on_the_work_clock_repeat_under_load():
    rng = random.Random(33)
    limited = 0
    for p, m, limit in ((4, 12, "1p"), (4, 16, "1.5p"), (3, 10, "1p")):
        profile = random_profile(rng, p)
        first, second = twice(solve, profile, m, limit, time_limit=0.3, deterministic=True)
        assert first.schedule.model_dump_json() == second.schedule.model_dump_json()
        assert first.info.clock == "work"
        limited += first.info.status == "time_limit"
    assert limited >= 1  # somewhere the limit cut the search short
    wall = solve(profile, m, limit, time_limit=0.3)
    assert wall.info.clock == "wall"


@pytest.mark.slow  # two plans of a second of work each, the second beside a burner
def test_plans_on_the_work_clock_repeat_under_load():
    layers = llama_layers(10, 512, 8000, heads=8, seq=512, microbatch_size=1, tflops=30.0, name="tiny")
    first, second = twice(plan, layers, 4, 8, None, placement="auto", time_limit=1.0, recompute="none",
                          deterministic=True)
    assert first.schedule.model_dump_json() == second.schedule.model_dump_json()
    part = first.partition
    assert part.clock == "work" and part.gap > 0 and part.time_s >= 0.5  # it searched until its limit


@pytest.mark.slow  # two searches, each with its worker process
def test_tunes_on_the_work_clock_repeat_under_load():
    profiles = [llama_layers(6, 512, 8000, heads=8, seq=512, microbatch_size=b, tflops=rate, name=f"tiny-b{b}")
                for b, rate in ((1, 30.0), (2, 40.0))]
    cluster = Cluster(ranks=4, ranks_per_node=4, memory_bytes=None, intra_node_gbs=20.0, inter_node_gbs=2.0)
    first, second = twice(tune, profiles, cluster, 16, time_limit=4.0, plan_time=0.2, deterministic=True)
    assert first.result.clock == "work"
    assert first.result.model_dump_json() == second.result.model_dump_json()
    assert first.schedule is not None and second.schedule is not None
    assert first.schedule.model_dump_json() == second.schedule.model_dump_json()
    assert sum(r.status == "costed" for r in first.result.rows) >= 3


def test_solve_deterministic_on_the_command_line(capsys):
    got = []
    for _ in range(2):
        code, out, err = run_main(capsys, "solve", "--profile", "1.5b-m24", "-m", "12", "--mem-limit", "1p",
                                  "--time-limit", "0.2", "--deterministic", "-o", "-")
        assert code == 0, err
        got.append(out)
    assert got[0] == got[1] and json.loads(got[0])["solver"]["clock"] == "work"
