"""DualPipeV (DeepSeek's DualPipe folded into a V; torch's ``ScheduleDualPipeV``), with its
forward-and-backward pairs overlapped where the profile has all-to-all to hide.

Rank r holds stages r and 2p-1-r, as in ZB-V. Its order, in eight steps (s0 = r, s1 = 2p-1-r):

1. 2(p-1-r) forwards on s0;
2. r+1 pairs of forwards, s0 then s1;
3. p-1-r times: B on s1, a pending W, F on s1 (zero bubble in the warm-up);
4. m-2p+r+1 times: F on s0 with the backward on s1, then F on s1 with the backward on s0 (the
   pairs DualPipe overlaps; the last rank's first one is run apart);
5. p-1-r times: the backward on s1, then F on s1 with the backward on s0;
6. r+1 pairs of backwards, s1 then s0, split (B, its W later) from the middle one on;
7. p-1-r times: a pending W, then the backward on s0 (split once step 6 split);
8. the W passes still pending.

Backwards are fused (BW) where DualPipe runs a full backward and split (B, W later) where it
runs zero-bubble halves. The pairs of steps 4 and 5 (an F followed by a BW of another
microbatch) are the ones DualPipe overlaps (``dualpipe_v_pairs``: the positions of their
forwards, ``Schedule.overlapped``); ``build_classic`` marks them where the profile has
all-to-all, as DeepSeek's and torch's DualPipeV do, and otherwise leaves the two passes one
after the other. Needs m >= 2p (as torch).
"""

from __future__ import annotations

from ..actions import Action, Op
from ..costs import CostModel
from ..errors import ZbError
from ..layout import placement

__all__ = ["dualpipe_v", "dualpipe_v_pairs"]


def dualpipe_v(cost: CostModel, m: int) -> list[list[Action]]:
    """DualPipeV's order on each rank (see the module)."""
    return [row for row, _ in _ranks(cost, m)]


def dualpipe_v_pairs(cost: CostModel, m: int) -> list[list[int]]:
    """Per rank, the positions in ``dualpipe_v``'s order of the forwards DualPipeV overlaps with
    the backward after them (steps 4 and 5; the last rank's first step-4 pair runs apart, as in
    DeepSeek's code, to send its forward sooner)."""
    return [pairs for _, pairs in _ranks(cost, m)]


def _ranks(cost: CostModel, m: int) -> list[tuple[list[Action], list[int]]]:
    p = cost.num_ranks
    if list(cost.stage_to_rank) != placement(p, 2, "v"):
        raise ZbError("dualpipe-v needs the V placement: rank r holds stages r and 2p-1-r")
    if m < 2 * p:
        raise ZbError(f"dualpipe-v needs at least 2p = {2 * p} microbatches, not {m}")
    return [_rank(p, m, r) for r in range(p)]


def _rank(p: int, m: int, r: int) -> tuple[list[Action], list[int]]:
    s0, s1 = r, 2 * p - 1 - r
    row: list[Action] = []
    pairs: list[int] = []  # positions of the forwards overlapped with the backward after them
    nxt = {(s, op): 0 for s in (s0, s1) for op in (Op.F, Op.B)}  # next microbatch per stage and kind
    pending: list[tuple[int, int]] = []  # W owed for split backwards, oldest first

    def forward(s: int) -> None:
        row.append(Action(s, Op.F, nxt[(s, Op.F)]))
        nxt[(s, Op.F)] += 1

    def backward(s: int, split: bool) -> None:
        j = nxt[(s, Op.B)]
        nxt[(s, Op.B)] += 1
        row.append(Action(s, Op.B if split else Op.BW, j))
        if split:
            pending.append((s, j))

    def weight() -> None:
        if pending:
            s, j = pending.pop(0)
            row.append(Action(s, Op.W, j))

    for _ in range(2 * (p - 1 - r)):
        forward(s0)
    for _ in range(r + 1):
        forward(s0)
        forward(s1)
    for _ in range(p - 1 - r):
        backward(s1, split=True)
        weight()
        forward(s1)
    for i in range(m - 2 * p + r + 1):
        if i or r != p - 1:
            pairs.append(len(row))
        forward(s0)
        backward(s1, split=False)
        pairs.append(len(row))
        forward(s1)
        backward(s0, split=False)
    for _ in range(p - 1 - r):
        backward(s1, split=False)
        pairs.append(len(row))
        forward(s1)
        backward(s0, split=False)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(s1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(s0, split)
    for _ in range(p - 1 - r):
        weight()
        backward(s0, split)
    while pending:
        weight()
    return row, pairs
