"""Choosing overlapped pairs: which forward runs together with which backward on a rank.

Where the passes hold all-to-all (``CostModel.has_all_to_all``), a rank may run a forward and
the backward of another microbatch after it as one overlapped pair, each one's all-to-all
hidden behind the other's compute (``CostModel.pair_time``). ``pair_passes`` improves a
schedule by local search over pairs, the simulator judging every step on the true costs:

* pair: a forward and the backward (B or BW) right after it, of another microbatch;
* pull: the next free backward of another microbatch moved up to just after a free forward,
  then paired with it (the passes in between move down by one);
* push: a free forward moved down to just before the next free backward, then paired;
* unpair: a pair split into its two passes again;
* swap: two adjacent passes that no pair holds exchanged, so that the order itself is searched
  with its pairs in place (a W moved into the gap a pair leaves, a backward sent on sooner).

A step is kept when the schedule still runs (no deadlock: a pair waits for the inputs of both
its passes), keeps its recompute passes before their backwards, stays within the memory
limit and shortens the objective; the search sweeps the ranks until a sweep keeps nothing or
its deadline passes.
"""

from __future__ import annotations

from collections.abc import Iterator

from .. import clock
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
    improves or ``deadline`` (a ``deadline.now()`` instant) passes: the rows, their pairs,
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
                if deadline is not None and clock.now() > deadline:
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
    """The rank's next orders and pairs to try (see the module), each a new row or ``row`` itself:
    for each free forward, pairing with the backward after it, then with each free backward of
    another microbatch within ``_WINDOW`` positions, moving one of the two next to the other."""
    held = set(pairs) | {i + 1 for i in pairs}
    n = len(row)
    for i, a in enumerate(row):
        if a.op is not Op.F or i in held:
            continue
        if i + 1 < n and i + 1 not in held and row[i + 1].op in _BACKWARDS and row[i + 1].mb != a.mb:
            yield row, sorted([*pairs, i])
        for k in range(max(0, i - _WINDOW), min(n, i + _WINDOW + 1)):
            b = row[k]
            if k in held or k in (i, i + 1) or b.op not in _BACKWARDS or b.mb == a.mb:
                continue
            if k > i:
                yield from _relocated(row, pairs, k, i + 1, i)  # pull: b up to just after a
                yield from _relocated(row, pairs, i, k - 1, k - 1)  # push: a down to just before b
            else:
                yield from _relocated(row, pairs, k, i, i - 1)  # b down to just after a
                yield from _relocated(row, pairs, i, k, k)  # a up to just before b
    for i in pairs:
        yield row, [p for p in pairs if p != i]
    for i in range(n - 1):  # the order itself, judged with its pairs: two free passes swapped
        a, b = row[i], row[i + 1]
        if i in held or i + 1 in held or (a.stage, a.mb) == (b.stage, b.mb) or a.op is b.op is Op.W:
            continue
        yield row[:i] + [b, a] + row[i + 2:], pairs


_WINDOW = 6  # how far apart a forward and a backward may be for a move to bring them together


def _relocated(row: list[Action], pairs: list[int], src: int, dst: int, pair_at: int) -> Iterator[tuple[list[Action], list[int]]]:
    """``row`` with the action at ``src`` moved to position ``dst`` (the others in between shift
    by one) and a pair starting at ``pair_at`` of the new row; nothing where a pair would be cut
    apart or a recompute pass would land after its backward."""
    lo, hi = min(src, dst), max(src, dst)
    if any(lo <= p <= hi and not (lo <= p + 1 <= hi) or lo <= p + 1 <= hi and not lo <= p <= hi for p in pairs):
        return  # a pair straddles the moved stretch
    moved = row[src]
    if src > dst and moved.op in _BACKWARDS and any(
            x.op in RECOMPUTES and (x.stage, x.mb) == (moved.stage, moved.mb) for x in row[dst:src]):
        return
    new = row[:src] + row[src + 1:]
    new.insert(dst, moved)
    shift = 1 if src > dst else -1
    kept = [p + shift if lo <= p <= hi and p != src else p for p in pairs]
    yield new, sorted([*kept, pair_at])
