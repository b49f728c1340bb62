"""Checkpointing an order: the least recomputation that brings a schedule within the limit.

Memory depends on the order alone, so a schedule built for more memory (ZB-H1, ZB-H2, 1F1B
with split backwards) can be brought below the limit by checkpointing some of its forwards,
each rebuilt by a recompute pass placed just before its backward. ``checkpointed`` walks each
rank's order once; at each pass where memory would exceed the limit it checkpoints, of the
microbatches held there whose backward comes after it, the one whose backward comes last (it
lowers memory over the longest stretch), with the recompute pass that keeps most (selective
before full); where every such microbatch is checkpointed already, it switches the last of
them to the recompute pass that keeps less; where none is left, it moves the oldest pending W
(its B already run) to just before that pass; until the pass fits, or else gives up (None).
Only the recompute passes the costs offer are used.

The result is a construction candidate of ``solve --recompute auto`` (``construct``): the
classic orders that need more memory than the limit, checkpointed only where the limit binds.
"""

from __future__ import annotations

from ..actions import RECOMPUTES, Action, Op
from ..costs import CostModel
from .problem import Problem

__all__ = ["checkpointed"]


def checkpointed(problem: Problem, rows: list[list[Action]]) -> list[list[Action]] | None:
    """``rows`` (their recompute passes dropped) with forwards checkpointed and recompute
    passes inserted until every rank's memory fits ``problem``'s limit, or None where that
    cannot be done this way."""
    c = problem.cost
    if problem.recompute != "auto" or not c.can_recompute:
        return None
    ways = [_ways(c, s) for s in range(c.num_stages)]
    out = []
    for limit, row in zip(problem.allowed(), rows):
        fitted = _fit_rank(c, ways, [a for a in row if a.op not in RECOMPUTES], limit)
        if fitted is None:
            return None
        out.append(fitted)
    return out


def _fit_rank(c: CostModel, ways: list[tuple[Op, ...]], base: list[Action], limit: float) -> list[Action] | None:
    """One rank's order ``base`` (no recompute passes) within ``limit`` (see the module), in
    one pass: memory before the first excess never changes, as every change lowers memory from
    a pass at or before it (a forward now checkpointed, a W moved) up to a pass after it."""
    order = list(base)
    backward = {(a.stage, a.mb): i for i, a in enumerate(order) if a.op in (Op.B, Op.BW)}  # their order
    way: dict[tuple[int, int], Op] = {}  # (stage, microbatch) -> its recompute pass
    held: dict[tuple[int, int], None] = {}  # forwards run whose recompute pass (or backward) has not
    waiting: dict[tuple[int, int], None] = {}  # B run, W not, oldest first
    out: list[Action] = []
    cur = 0.0
    i = 0
    while i < len(order):
        a = order[i]
        k = (a.stage, a.mb)
        if a.op is Op.W:
            waiting.pop(k, None)
        passes = [a]
        if a.op in (Op.B, Op.BW) and k in way:
            passes.insert(0, Action(a.stage, way[k], a.mb))
        for x in passes:
            if x.op is Op.F:
                held[k] = None
                cur += c.m_f[x.stage]  # less once checkpointed (_fix)
            else:
                held.pop(k, None)
                cur += c.memory(x.stage, x.op)
            cur = _fix(c, ways, cur, limit, way, held, backward)
            while cur > limit:  # the oldest W waiting runs just before this pass instead
                w = _move_w(order, i, waiting)
                if w is None:
                    return None
                i += 1
                out.append(w)
                cur += c.memory(w.stage, Op.W)
            out.append(x)
        if a.op is Op.B:
            waiting[k] = None
        i += 1
    return out


def _fix(c: CostModel, ways: list[tuple[Op, ...]], cur: float, limit: float, way: dict[tuple[int, int], Op],
         held: dict[tuple[int, int], None], backward: dict[tuple[int, int], int]) -> float:
    """Memory after checkpointing held microbatches until it fits ``limit`` or none can keep
    less: the one whose backward comes last first (selective before full, then a lesser pass)."""
    while cur > limit:
        fresh = [k for k in held if k not in way and ways[k[0]]]
        if fresh:
            k = max(fresh, key=backward.__getitem__)
            way[k] = ways[k[0]][0]
            cur -= c.memory(k[0], way[k])
            continue
        lesser = [k for k in held if k in way and way[k] is not ways[k[0]][-1]]
        if not lesser:
            break
        k = max(lesser, key=backward.__getitem__)
        less = ways[k[0]][ways[k[0]].index(way[k]) + 1]
        cur -= c.memory(k[0], less) - c.memory(k[0], way[k])
        way[k] = less
    return cur


def _ways(c: CostModel, s: int) -> tuple[Op, ...]:
    """The recompute passes stage s offers, the one that keeps most first."""
    return tuple(sorted(c.recompute_ops(s), key=lambda op: -c.offer(s, op).keep))  # type: ignore[union-attr]


def _move_w(order: list[Action], i: int, waiting: dict[tuple[int, int], None]) -> Action | None:
    """Move the oldest W waiting (its B before position i, itself after) to position i."""
    if not waiting:
        return None
    k = next(iter(waiting))
    del waiting[k]
    w = Action(k[0], Op.W, k[1])
    order.insert(i, order.pop(order.index(w, i)))
    return w
