"""V-Half and V-Min: V schedules below 1F1B's memory (Qi et al., "Pipeline Parallelism with
Controllable Memory", arXiv 2405.15362).

The paper builds a schedule from one *building block*, where one microbatch's passes sit on
each device, repeated every 6 time units (F and B of both chunks, and the two W passes, one
unit each): the steady state is then free of bubbles, and a device's peak memory is the sum of
its microbatches' lifespans divided by the interval. On the V placement (rank r holds stages r
and 2p-1-r) the blocks below put microbatch 0's forward on chunk 0, forward on chunk 1,
backward on chunk 1 and backward on chunk 0 of device i at unit

* V-Min: i, 2p-1-i, 2p+d+i, 4p+d-1-i (d = 2 where 3 divides p, else 0): consecutive devices
  one unit apart, about a third of 1F1B's memory ((p+4)//3 microbatches);
* V-Half: 2i, 3p-2-i, 3p+d-1+2i, 6p+d-2-i (d = 3 where p is even, else 0): two units apart
  going down, about half ((p+2)//2 microbatches),

and microbatch j at the same units plus 6j. W passes fill the units left free, oldest
backward first. The repetition leaves idle units in the warm-up and cool-down, which the paper
*squeezes*: each pass outside the steady state moves to the earliest free unit its inputs allow
that does not raise the device's peak memory; the W passes are taken out, the forwards and
backwards squeezed once more, and the W passes put back into the units left free, chunk 1's
first. Like the authors' generator, the construction counts unit times and unit memory (a
chunk's forward allocates 1, its W frees it); the order it gives is then timed on the real
costs by the simulator, as their runtime runs it.

Squeezing tries every free unit of every pass outside the steady state, which on many ranks and
microbatches takes seconds: given a ``deadline``, it stops there and the blocks as squeezed so
far are returned (every move keeps the passes' inputs before them and the peak within the
block's, so a squeeze stopped anywhere is a valid schedule; ``deadline.passed``).
"""

from __future__ import annotations

from ..actions import Action, Op
from ..clock import passed
from ..costs import CostModel
from ..errors import ZbError
from ..layout import placement

__all__ = ["v_half", "v_min", "building_block"]

# Pass kinds of a device, in the block's order: F on chunk 0, F on chunk 1, B on chunk 1, B on
# chunk 0, then W (chunk 1's and chunk 0's, as W1 and W0 when split by chunk).
_F0, _F1, _B1, _B0, _W = range(5)
_UNIT_MEMORY = {_F0: 1, _F1: 1, _B1: 0, _B0: 0}  # a W frees 1


def building_block(p: int, kind: str) -> list[list[int]]:
    """Per device, the units of microbatch 0's F0, F1, B1, B0 (see the module)."""
    if kind == "v-min":
        d = 2 if p % 3 == 0 else 0
        return [[i, 2 * p - 1 - i, 2 * p + d + i, 4 * p + d - 1 - i] for i in range(p)]
    if kind == "v-half":
        d = 3 if p % 2 == 0 else 0
        return [[2 * i, 3 * p - 2 - i, 3 * p + d - 1 + 2 * i, 6 * p + d - 2 - i] for i in range(p)]
    raise ZbError(f"unknown building block {kind!r}: 'v-half' or 'v-min'")


def v_half(cost: CostModel, m: int, deadline: float | None = None) -> list[list[Action]]:
    """V-Half on the V placement, squeezed until ``deadline`` at most."""
    return _controllable(cost, m, "v-half", deadline)


def v_min(cost: CostModel, m: int, deadline: float | None = None) -> list[list[Action]]:
    """V-Min on the V placement, squeezed until ``deadline`` at most."""
    return _controllable(cost, m, "v-min", deadline)


def _controllable(cost: CostModel, m: int, kind: str, deadline: float | None) -> list[list[Action]]:
    p = cost.num_ranks
    if list(cost.stage_to_rank) != placement(p, 2, "v"):
        raise ZbError(f"{kind} needs the V placement: rank r holds stages r and 2p-1-r")
    block = building_block(p, kind)
    # units[i][k][j]: unit of device i's pass kind k (F0, F1, B1, B0) of microbatch j
    units = [[[start + 6 * j for j in range(m)] for start in dev] for dev in block]
    grid = _Grid(p, m, units)
    grid.place_w(split=False)
    grid.squeeze(with_w=True, deadline=deadline)
    grid.drop_w()
    grid.squeeze(with_w=False, deadline=deadline)
    grid.drop_w()
    grid.place_w(split=True)
    return grid.actions()


class _Grid:
    """Every pass of every device at a unit time; W passes as per-device lists of units."""

    def __init__(self, p: int, m: int, units: list[list[list[int]]]):
        self.p, self.m, self.units = p, m, units
        self.w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # per device: (unit, chunk of its W)

    # ---- W passes ------------------------------------------------------------------------

    def place_w(self, split: bool, device: int | None = None) -> None:
        """Each device's W passes (``device``'s only, where given: they depend on its own
        passes alone) into its free units, one per backward already run, oldest first
        (``split``: a W of chunk 1 before one of chunk 0); those left over at the end."""
        for i in range(self.p) if device is None else (device,):
            busy = {u: k for k in range(4) for u in self.units[i][k]}
            end = max(busy)
            owed = {1: 0, 0: 0}  # by chunk
            out: list[tuple[int, int]] = []
            for u in range(end + 1):
                if u in busy:
                    if busy[u] in (_B1, _B0):
                        owed[1 if busy[u] == _B1 else 0] += 1
                    continue
                for chunk in (1, 0):
                    if owed[chunk] and (split or chunk == 1 or not owed[1]):
                        owed[chunk] -= 1
                        out.append((u, chunk))
                        break
            u = end
            for chunk in (1, 0):
                while owed[chunk]:
                    u += 1
                    owed[chunk] -= 1
                    out.append((u, chunk))
            self.w[i] = out

    def drop_w(self) -> None:
        self.w = [[] for _ in range(self.p)]

    # ---- memory --------------------------------------------------------------------------

    def peak(self, i: int) -> int:
        """Device i's peak unit memory: each forward allocates 1, each W frees 1; without W
        passes placed, each free unit runs a W owed by an earlier backward, as ``place_w`` will."""
        busy = {u: k for k in range(4) for u in self.units[i][k]}
        freeing = {u for u, _ in self.w[i]}
        cur = top = owed = 0
        for u in range(max(busy) + 1):
            k = busy.get(u)
            if k is not None:
                cur += _UNIT_MEMORY[k]
                owed += k in (_B1, _B0)
            elif u in freeing or (not self.w[i] and owed):
                cur -= 1
                owed -= 1
            if cur > top:
                top = cur
        return top

    # ---- squeezing -----------------------------------------------------------------------

    def earliest(self, i: int, k: int, j: int) -> int:
        """The first unit pass (i, k, j) may take: after its inputs (the same microbatch on
        the device before or after, the pass before it on this device) and the same kind's
        previous microbatch."""
        u = self.units
        deps = []
        if k in (_F0, _B1) and i > 0:
            deps.append(u[i - 1][k][j])
        if k in (_F1, _B0) and i < self.p - 1:
            deps.append(u[i + 1][k][j])
        if k > _F0:
            deps.append(u[i][k - 1][j])
        if j:
            deps.append(u[i][k][j - 1])
        return max(deps, default=-1) + 1

    def steady(self, k: int, j: int, i: int) -> bool:
        """Whether pass (i, k, j) lies in the steady state, which squeezing leaves alone: from
        device 0's first chunk-0 backward to its last chunk-0 forward, in unit order."""
        start = self.units[0][_B0][0]
        stop = self.units[0][_F0][self.m - 1]
        return start <= self.units[i][k][j] <= stop

    def squeeze(self, with_w: bool, deadline: float | None = None) -> None:
        """Move each pass outside the steady state to the earliest free unit its inputs allow
        that keeps every device's peak within the current one (``with_w``: W passes placed,
        which also lets the warm-up move; without, only the cool-down moves); the passes left
        stay where they are once ``deadline`` has passed."""
        if passed(deadline):
            return
        cap = max(self.peak(i) for i in range(self.p))
        passes = sorted((self.units[i][k][j], i, k, j) for i in range(self.p) for k in range(4) for j in range(self.m))
        first_b0 = self.units[0][_B0][0]
        occupied = [{self.units[i][k][j] for k in range(4) for j in range(self.m)} | {u for u, _ in self.w[i]}
                    for i in range(self.p)]
        for now, i, k, j in passes:
            if passed(deadline):
                return
            if self.steady(k, j, i) or (not with_w and now < first_b0):
                continue
            lo = self.earliest(i, k, j)
            for u in range(lo, now):
                if u in occupied[i]:
                    continue
                self.units[i][k][j] = u
                if self.peak(i) <= cap:
                    occupied[i].discard(now)
                    occupied[i].add(u)
                    break
                self.units[i][k][j] = now
            if with_w and self.units[i][k][j] != now:
                self.place_w(split=False, device=i)  # its W passes follow the backwards they owe
                occupied[i] = {self.units[i][kk][jj] for kk in range(4) for jj in range(self.m)} | {x for x, _ in self.w[i]}

    # ---- the order -----------------------------------------------------------------------

    def actions(self) -> list[list[Action]]:
        """Per rank, its passes in unit order; a W names its chunk's stage, oldest first."""
        p = self.p
        rows = []
        for i in range(p):
            lo, hi = i, 2 * p - 1 - i
            stage = {_F0: lo, _F1: hi, _B1: hi, _B0: lo}
            op = {_F0: Op.F, _F1: Op.F, _B1: Op.B, _B0: Op.B}
            timed = [(self.units[i][k][j], k, Action(stage[k], op[k], j)) for k in range(4) for j in range(self.m)]
            nxt = {0: 0, 1: 0}
            for u, chunk in self.w[i]:
                s = hi if chunk == 1 else lo
                timed.append((u, _W, Action(s, Op.W, nxt[chunk])))
                nxt[chunk] += 1
            rows.append([a for _, _, a in sorted(timed, key=lambda x: (x[0], x[1]))])
        return rows
