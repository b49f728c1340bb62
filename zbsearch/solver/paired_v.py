"""A V schedule built around overlapped pairs: DualPipeV's order with the pairs it can form.

Rank r holds stages s0 = r and s1 = 2p-1-r (the V placement). Its order:

1. warm-up, as DualPipeV: 2(p-1-r) forwards on s0, then r+1 forwards on s0 and s1 in turn
   (no backward has reached the rank yet: these cannot pair);
2. ramp, p-1-r times: the next forward on s1 paired with the oldest backward on s1, then a W;
   or, with the step unpaired, DualPipeV's: the backward alone, a W, then the forward. A ramp
   pair on rank r needs the forward that a pair of rank r+1 sends, and rank r+1's next pair
   needs this pair's backward: the two ranks wait on each other's pairs in turn, which can
   cost more than the pairs hide. So the ramp is paired in full, not at all, or in its last k
   steps on every rank (the early steps, where the turns begin, unpaired; the late ones, where
   a rank's ramp meets the steady state of the rank below, paired); the candidates are the
   first two and the best k by simulation;
3. steady state, m-2p+r+1 times: F on s0 paired with B on s1, F on s1 paired with B on s0;
4. p-1-r times: B on s1, then F on s1 paired with B on s0 (no forward on s0 is left);
5. cool-down, as DualPipeV's: r+1 times B on s1 then on s0, p-1-r times a W then B on s0, the
   W passes still pending.

Backwards are split: their W passes run ``lag`` backwards later (0: right after the pair or
pass that holds their B), so a pair ends as soon as its B is done and sends its gradient on,
and the W passes left at the end fill the cool-down, as in the zero-bubble schedules. Every
pair is a forward and a backward of another microbatch (``Schedule.overlapped``). Needs
m >= 2p. Memory: one W held per unit of ``lag`` beyond DualPipeV's peak.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..actions import Action, Op
from ..costs import CostModel
from ..errors import ZbError
from ..layout import placement
from ..tolerances import REL_TOL
from .problem import Problem

__all__ = ["paired_v", "paired_v_candidates"]

# the lags tried as candidates: W at once, or one behind (a W more held)
_LAGS = (0, 1)


def paired_v(cost: CostModel, m: int, lag: int = 0, ramp: bool | int = True) -> tuple[list[list[Action]], list[list[int]]]:
    """Per-rank orders and overlapped pairs (see the module; ``ramp``: pair the whole ramp
    (True), none of it (False), or an int k: each rank's last k ramp steps)."""
    p = cost.num_ranks
    if list(cost.stage_to_rank) != placement(p, 2, "v"):
        raise ZbError("the paired V schedule needs the V placement: rank r holds stages r and 2p-1-r")
    if m < 2 * p:
        raise ZbError(f"the paired V schedule needs at least 2p = {2 * p} microbatches, not {m}")
    depth = (p if ramp else 0) if isinstance(ramp, bool) else ramp
    out = [_rank(p, m, r, lag, depth) for r in range(p)]
    return [row for row, _ in out], [pairs for _, pairs in out]


def paired_v_candidates(problem: Problem, expired: Callable[[], bool] | None = None,
                        ) -> list[tuple[str, list[list[Action]], list[list[int]]]]:
    """The paired V schedules (name, orders, pairs) for ``problem`` within its memory limit by
    their order alone: none where its passes hold no all-to-all, its placement is not the V, m
    is below 2p or every pass must be recomputed. The ramp depth's search stops early, with
    the best depth so far, once ``expired()`` (None: never)."""
    c, m = problem.cost, problem.num_microbatches
    if not c.has_all_to_all or problem.recompute == "full" or m < 2 * c.num_ranks:
        return []
    if list(c.stage_to_rank) != placement(c.num_ranks, 2, "v"):
        return []
    out = []
    ramps = [ramp for ramp in (True, False, _best_depth(problem, expired)) if ramp is not None]
    for ramp in ramps:
        for lag in _LAGS:
            rows, pairs = paired_v(c, m, lag, ramp)
            if problem.fits_order(rows):
                what = "" if ramp is True else ", ramp unpaired" if ramp is False else f", ramp paired in its last {ramp} steps"
                out.append((f"paired v (W lag {lag}{what})", rows, pairs))
    return out


def _best_depth(problem: Problem, expired: Callable[[], bool] | None) -> int | None:
    """The k in 1..p-2 whose ramp paired in its last k steps (W lag 0) is faster than the ramp
    paired in full and unpaired, within the memory limit: the span taken as unimodal in k (it
    gains while a late ramp pair hides more than its rank waits for it), found by ternary search
    over 0..p-1 (a few simulations, until ``expired()``); None where none is faster."""
    c, m = problem.cost, problem.num_microbatches
    seen: dict[int, float] = {}

    def value(k: int) -> float:
        if k not in seen:
            rows, pairs = paired_v(c, m, 0, k)
            seen[k] = float("inf")
            if problem.fits_order(rows):
                try:
                    v, tl = problem.evaluate(rows, pairs)
                except ZbError:  # (not expected: the construction runs at any depth)
                    return seen[k]
                if problem.fits(tl):
                    seen[k] = v
        return seen[k]

    lo, hi = 0, c.num_ranks - 1  # 0: the ramp unpaired, p-1: paired in full (every rank's ramp is shorter)
    while hi - lo > 2 and not (expired is not None and expired()):
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if value(a) <= value(b):
            hi = b
        else:
            lo = a
    cut = expired is not None and expired()  # then the best depth simulated so far
    k = min(seen, key=seen.__getitem__, default=0) if cut else min(range(lo, hi + 1), key=value)
    if not 0 < k < c.num_ranks - 1:
        return None
    return k if value(k) < min(value(0), value(c.num_ranks - 1)) * (1 - REL_TOL) else None


def _rank(p: int, m: int, r: int, lag: int, depth: int) -> tuple[list[Action], list[int]]:
    s0, s1 = r, 2 * p - 1 - r
    row: list[Action] = []
    pairs: list[int] = []
    nxt = {(s, op): 0 for s in (s0, s1) for op in (Op.F, Op.B)}
    pending: deque[tuple[int, int]] = deque()

    def take(s: int, op: Op) -> Action:
        j = nxt[(s, op)]
        nxt[(s, op)] += 1
        if op is Op.B:
            pending.append((s, j))
        return Action(s, op, j)

    def weights(keep: int) -> None:
        while len(pending) > keep:
            s, j = pending.popleft()
            row.append(Action(s, Op.W, j))

    def pair(f: int, b: int, keep: int) -> None:
        pairs.append(len(row))
        row.append(take(f, Op.F))
        row.append(take(b, Op.B))
        weights(keep)

    def alone(s: int, op: Op) -> None:
        row.append(take(s, op))

    for _ in range(2 * (p - 1 - r)):
        alone(s0, Op.F)
    for _ in range(r + 1):
        alone(s0, Op.F)
        alone(s1, Op.F)
    for k in range(p - 1 - r):
        if k >= p - 1 - r - depth:  # one of the rank's last ``depth`` ramp steps
            pair(s1, s1, lag)
        else:
            alone(s1, Op.B)
            weights(lag)
            alone(s1, Op.F)
    for _ in range(m - 2 * p + r + 1):
        pair(s0, s1, lag)
        pair(s1, s0, lag)
    for _ in range(p - 1 - r):
        alone(s1, Op.B)
        weights(lag)
        pair(s1, s0, lag)
    for _ in range(r + 1):
        alone(s1, Op.B)
        alone(s0, Op.B)
    for _ in range(p - 1 - r):
        weights(max(0, len(pending) - 1))
        alone(s0, Op.B)
    weights(0)
    return row, pairs
