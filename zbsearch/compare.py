"""``compare``: every schedule kind side by side on one profile, within one time limit.

The rows are the classic schedules (``classic.KINDS``) and the solver's ZB-1p and ZB-2p from
its heuristics only (no MILP, so `zbsearch solve` may find better). ``time_limit`` covers the
whole table: the classic rows are built while the first half lasts (ZB-V, which repeats its
construction, stops repeating there), then the two solver rows share what is left. A row not
started by then is not built: it is listed with ``skipped`` saying so, never left out, so a
table cut short says which rows it lacks.

Where the profile has all-to-all to hide (``Profile.has_all_to_all``), a kind that overlaps
forward-backward pairs (dualpipe-v) runs them overlapped, and a row ``KIND (no overlap)``
follows it with the same order run one pass after the other: what the overlap gains.

Where the profile ends the iteration with gradient reductions (``zbsearch.reductions``), each
row also has its ``iteration`` (ms, the longest rank's) and ``gain_kept``: how much of its
span's gain over 1F1B remains in the iteration (``reductions.gain_kept``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .classic import CLASSIC_KINDS, KINDS, build_classic
from .costs import CostModel
from .errors import ZbError
from .formats.profile import Profile
from .formats.schedule import Schedule
from .limits import parse_memory_limit, peaks_fit
from .reductions import gain_kept

__all__ = ["SOLVED_KINDS", "NO_OVERLAP", "compare"]

NO_OVERLAP = "(no overlap)"  # the suffix of a row that runs an overlapping kind's pairs one pass after the other

SOLVED_KINDS = ("zb-1p", "zb-2p")  # the solver's heuristics at 1p and 2p

Progress = Callable[[str, float, float], None]  # (what is being done, best value, lower bound), as ``solver.Progress``


def compare(
    profile: Profile, num_microbatches: int, *, chunks: int | None = None, mem_limit: str | None = None, time_limit: float = 2.0,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """One row per kind (classic, then ``SOLVED_KINDS``): its prediction, whether it fits
    ``mem_limit``, or ``error`` (the kind does not apply) or ``skipped`` (out of time); a solver
    row also its ``status`` and the schedules its bound covers (``bound_covers``: without
    recomputation, which these rows never search)."""
    from .solver import solve  # the solver pulls in more than the classic rows need

    m = num_microbatches
    # the profile's own placement where its stages are pieces measured for one (a V, interleaved)
    plain = CostModel.from_profile(profile, profile.placement or list(range(profile.num_stages)))
    plain.check_microbatches(m)  # else every row says it (rows with more stages still may)
    parse_memory_limit(mem_limit, profile, plain)  # bad text: fail now
    start = time.monotonic()
    deadline = start + time_limit
    half = start + time_limit / 2
    rows: list[dict[str, Any]] = []

    def say(what: str, value: float = float("inf"), bound: float = 0.0) -> None:
        if progress is not None:
            progress(what, value, bound)

    for kind in CLASSIC_KINDS:
        if time.monotonic() > half:
            rows.append(_skipped(kind, time_limit))
            continue
        say(f"building {kind}")
        try:
            sched = build_classic(kind, profile, m, chunks if KINDS[kind].any_chunks else None, deadline=half)
        except ZbError as e:
            rows.append({"kind": kind, "error": str(e)})
            continue
        rows.append(_row(kind, sched, profile, mem_limit))
        if sched.overlapped is not None:
            serial = build_classic(kind, profile, m, chunks if KINDS[kind].any_chunks else None, deadline=half, overlap=False)
            rows.append(_row(f"{kind} {NO_OVERLAP}", serial, profile, mem_limit))
    for i, kind in enumerate(SOLVED_KINDS):
        left = deadline - time.monotonic()
        if left <= 0:
            rows.append(_skipped(kind, time_limit))
            continue
        def said(phase: str, value: float, bound: float, kind: str = kind) -> None:
            say(f"{kind}: {phase}", value, bound)

        try:
            res = solve(profile, m, kind.removeprefix("zb-"), milp=False, time_limit=left / (len(SOLVED_KINDS) - i),
                        progress=said)
        except ZbError as e:
            rows.append({"kind": kind, "error": str(e)})
            continue
        rows.append({**_row(kind, res.schedule, profile, mem_limit), "status": res.info.status,
                     "bound_covers": res.info.bound_covers})
    base = next((r for r in rows if r["kind"] == "1f1b" and "iteration" in r), None)
    for r in rows:
        if base is not None and "iteration" in r and r is not base:
            r["gain_kept"] = gain_kept(base["span"], base["iteration"], r["span"], r["iteration"])
    return rows


def _skipped(kind: str, time_limit: float) -> dict[str, Any]:
    return {"kind": kind, "skipped": f"time limit ({time_limit:g} s) spent"}


def _row(kind: str, sched: Schedule, profile: Profile, mem_limit: str | None) -> dict[str, Any]:
    pred = sched.predicted
    assert pred is not None  # build_classic and solve predict
    limit = parse_memory_limit(mem_limit, profile, CostModel.from_profile(profile, sched.stage_to_rank))
    row: dict[str, Any] = {
        "kind": kind, "bubble_rate": pred.bubble_rate, "span": max(pred.span), "makespan": pred.makespan,
        "peak_memory": max(pred.peak_memory), "lower_bound": pred.lower_bound,
        "fits": peaks_fit(pred.peak_memory, limit),
    }
    if pred.iteration is not None:
        row["iteration"] = max(pred.iteration)
    return row
