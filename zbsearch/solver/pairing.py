"""Choosing overlapped pairs: which forward runs together with which backward on a rank.

Where the passes hold all-to-all (``CostModel.has_all_to_all``), a rank may run a forward and
the backward of another microbatch after it as one overlapped pair, each one's all-to-all
hidden behind the other's compute (``CostModel.pair_time``). ``pair_passes`` improves a
schedule by local search over pairs, the simulator judging every step on the true costs:

* pair: a forward and the backward (B or BW) right after it, of another microbatch;
* pull: the next free backward of another microbatch moved up to just after a free forward,
  then paired with it (the passes in between move down by one);
* push: a free forward moved down to just before the next free backward, then paired;
* unpair: a pair split into its two passes again.

A step is kept when the schedule still runs (no deadlock: a pair waits for the inputs of both
its passes), keeps its recompute passes before their backwards, stays within the memory
limit and shortens the objective; the search sweeps the ranks until a sweep keeps nothing or
its deadline passes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..actions import RECOMPUTES, Action, Op
from ..errors import ZbError
from ..simulator import Timeline
from ..tolerances import REL_TOL
from .problem import Problem

__all__ = ["Paired", "pair_passes"]

Rows = list[list[Action]]
Pairs = list[list[int]]
Paired = tuple[Rows, Pairs, float, Timeline]  # rows, pairs, objective value, timeline
_BACKWARDS = (Op.B, Op.BW)


def pair_passes(problem: Problem, rows: Rows, pairs: Pairs | None = None, deadline: float | None = None) -> Paired:
    """``rows`` (with ``pairs``, None: none) improved by the moves of the module until none
    improves or ``deadline`` (a ``time.monotonic()`` instant) passes: the rows, their pairs,
    the objective and the timeline, on ``problem``'s costs. ``rows`` must run and fit."""
    rows = [list(r) for r in rows]
    pairs = [sorted(p) for p in pairs] if pairs is not None else [[] for _ in rows]
    value, tl = problem.evaluate(rows, pairs)
    if not problem.cost.has_all_to_all:
        return rows, pairs, value, tl
    improved = True
    while improved:
        improved = False
        for r in range(len(rows)):
            for new_row, new_pairs in _moves(rows[r], pairs[r]):
                if deadline is not None and time.monotonic() > deadline:
                    return rows, pairs, value, tl
                trial_rows, trial_pairs = rows[:r] + [new_row] + rows[r + 1:], pairs[:r] + [new_pairs] + pairs[r + 1:]
                if new_row is not rows[r] and not problem.fits_order(trial_rows):
                    continue
                try:
                    v, t = problem.evaluate(trial_rows, trial_pairs)
                except ZbError:  # the step deadlocks
                    continue
                if v < value * (1 - REL_TOL) and problem.fits(t):
                    rows, pairs, value, tl = trial_rows, trial_pairs, v, t
                    improved = True
                    break  # the rank's moves again, from its new order
    return rows, pairs, value, tl


def _moves(row: list[Action], pairs: list[int]) -> Iterator[tuple[list[Action], list[int]]]:
    """The rank's next orders and pairs to try (see the module), each a new row or ``row`` itself."""
    held = set(pairs) | {i + 1 for i in pairs}
    n = len(row)
    for i, a in enumerate(row):
        if a.op is not Op.F or i in held:
            continue
        if i + 1 < n and i + 1 not in held and row[i + 1].op in _BACKWARDS and row[i + 1].mb != a.mb:
            yield row, sorted([*pairs, i])
            continue
        k = next((k for k in range(i + 2, n) if k not in held and row[k].op in _BACKWARDS and row[k].mb != a.mb), None)
        if k is None:
            continue
        b = row[k]
        if not any(x.op in RECOMPUTES and (x.stage, x.mb) == (b.stage, b.mb) for x in row[i + 1:k]):
            new = row[:i + 1] + [b] + row[i + 1:k] + row[k + 1:]  # pull: b up to just after a
            yield new, sorted([*(p + 1 if i < p < k else p for p in pairs), i])
        if not any((x.stage, x.mb) == (a.stage, a.mb) or x.op is Op.F and x.stage > a.stage and x.mb == a.mb
                   for x in row[i + 1:k]):
            new = row[:i] + row[i + 1:k] + [a] + row[k:]  # push: a down to just before b
            yield new, sorted([*(p - 1 if i < p < k else p for p in pairs), k - 1])
    for i in pairs:
        yield row, [p for p in pairs if p != i]
