"""bench/data_parallel.py's ``replica_drift``: generated rounds of two replicas' reductions,
one replica's starts shifted by known amounts, against those amounts."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # its siblings, as it imports them
from bench.data_parallel import replica_drift  # noqa: E402


@pytest.mark.parametrize("seed", range(20))
def test_replica_drift_is_the_replicas_shift(seed):
    rng = random.Random(seed)
    ranks, stages, rounds = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 5)
    lanes: dict[str, list] = {f"{rep} {r}": [] for rep in (0, 1) for r in range(ranks)}
    shifts, took = [], 0.0
    for _ in range(rounds):
        for r in range(ranks):
            mine: dict[int, list] = {0: [], 1: []}
            for s in range(stages):
                start, shift = rng.uniform(0, 500), rng.uniform(-20, 20)
                end = start + max(shift, 0.0) + rng.uniform(1, 50)  # completes after the later start
                mine[0].append((r + ranks * s, start, end))
                mine[1].append((r + ranks * s, start + shift, end))
                shifts.append(abs(shift))
                took += (end - start) + (end - start - shift)
            for rep in (0, 1):
                lanes[f"{rep} {r}"].append(mine[rep])
    got = replica_drift(lanes)
    assert got["replica_skew_ms"] == pytest.approx(statistics.median(shifts))
    assert got["replica_skew_max_ms"] == pytest.approx(max(shifts))
    assert got["later_replica_wait_share"] == pytest.approx(sum(shifts) / took)
