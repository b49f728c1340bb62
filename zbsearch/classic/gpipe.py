"""GPipe: every forward, then every (fused) backward. Peak memory m * M_B."""

from ..actions import Action, Op


def gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action(r, Op.F, j) for j in range(m)] + [Action(r, Op.BW, j) for j in range(m)] for r in range(p)]
