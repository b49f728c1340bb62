"""A V schedule built around overlapped pairs: DualPipeV's order with the pairs it can form.

Rank r holds stages s0 = r and s1 = 2p-1-r (the V placement). Its order:

1. warm-up, as DualPipeV: 2(p-1-r) forwards on s0, then r+1 forwards on s0 and s1 in turn
   (no backward has reached the rank yet: these cannot pair);
2. ramp, p-1-r times: the next forward on s1 paired with the oldest backward on s1, then a W;
   or, with the ramp unpaired, DualPipeV's: the backward alone, a W, then the forward. A ramp
   pair on rank r needs the forward that a pair of rank r+1 sends, and rank r+1's next pair
   needs this pair's backward: the two ranks wait on each other's pairs in turn, which can
   cost more than the pairs hide (both are candidates);
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

from ..actions import Action, Op
from ..costs import CostModel
from ..errors import ZbError
from ..layout import placement
from .problem import Problem

__all__ = ["paired_v", "paired_v_candidates"]

# the lags tried as candidates: W at once, or one behind (a W more held)
_LAGS = (0, 1)


def paired_v(cost: CostModel, m: int, lag: int = 0, ramp: bool = True) -> tuple[list[list[Action]], list[list[int]]]:
    """Per-rank orders and overlapped pairs (see the module; ``ramp``: pair in the ramp)."""
    p = cost.num_ranks
    if list(cost.stage_to_rank) != placement(p, 2, "v"):
        raise ZbError("the paired V schedule needs the V placement: rank r holds stages r and 2p-1-r")
    if m < 2 * p:
        raise ZbError(f"the paired V schedule needs at least 2p = {2 * p} microbatches, not {m}")
    out = [_rank(p, m, r, lag, ramp) for r in range(p)]
    return [row for row, _ in out], [pairs for _, pairs in out]


def paired_v_candidates(problem: Problem) -> list[tuple[str, list[list[Action]], list[list[int]]]]:
    """The paired V schedules (name, orders, pairs) for ``problem`` within its memory limit by
    their order alone: none where its passes hold no all-to-all, its placement is not the V, m
    is below 2p or every pass must be recomputed."""
    c, m = problem.cost, problem.num_microbatches
    if not c.has_all_to_all or problem.recompute == "full" or m < 2 * c.num_ranks:
        return []
    if list(c.stage_to_rank) != placement(c.num_ranks, 2, "v"):
        return []
    out = []
    for ramp in (True, False):
        for lag in _LAGS:
            rows, pairs = paired_v(c, m, lag, ramp)
            if problem.fits_order(rows):
                out.append((f"paired v (W lag {lag}{'' if ramp else ', ramp unpaired'})", rows, pairs))
    return out


def _rank(p: int, m: int, r: int, lag: int, ramp: bool) -> tuple[list[Action], list[int]]:
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
    for _ in range(p - 1 - r):
        if ramp:
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
