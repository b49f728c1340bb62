"""The exact oracle's optima for many jobs, kept between runs in a JSON file.

Solving the oracle takes minutes per instance; a cache keyed by everything it reads (profile,
m, chunks, limit, objective, options, time limit) lets a bench be re-run or extended without
solving again. Cached results keep value, proof and bound, not the schedule.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.solver.oracle import OracleResult, cp_optimum_many


def _key(inst, objective, opts, oracle_time: float) -> str:
    blob = [inst.profile.model_dump(mode="json"), inst.m, inst.chunks, inst.limit, objective, opts, oracle_time]
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def cached_optima(jobs, oracle_time: float, processes: int | None, cache: str | None) -> list[OracleResult]:
    """``cp_optimum_many`` for (instance, objective, options) jobs, through the JSON file
    ``cache`` when given (results read from it have no schedule)."""
    path = Path(cache) if cache else None
    known = json.loads(path.read_text()) if path is not None and path.exists() else {}
    keys = [_key(*j, oracle_time) for j in jobs]
    todo = [(j, k) for j, k in zip(jobs, keys) if k not in known]
    found = cp_optimum_many([(i.cost, i.m, i.limit, o, opts) for (i, o, opts), _ in todo],
                            time_limit=oracle_time, processes=processes)
    for (_, k), res in zip(todo, found):
        known[k] = [res.value, res.optimal, res.bound]
    if path is not None and todo:
        path.write_text(json.dumps(known))
    return [OracleResult(*_fields(known[k])) for k in keys]


def _fields(entry: list) -> tuple:
    value, optimal, *bound = entry  # files written before the bound was kept hold two fields
    return value, [], optimal, bound[0] if bound else (value if optimal else float("-inf"))
