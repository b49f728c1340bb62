"""GPipe: every forward, then every (fused) backward. Peak memory m * M_B."""

from ..actions import Action, Op
from ..costs import CostModel


def gpipe(cost: CostModel, m: int) -> list[list[Action]]:
    """GPipe's order on each rank: F of every microbatch, then BW of every microbatch."""
    return [[Action(r, Op.F, j) for j in range(m)] + [Action(r, Op.BW, j) for j in range(m)] for r in range(cost.num_ranks)]
