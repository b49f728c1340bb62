"""1F1B: p-1-r warm-up forwards on rank r, then one forward / one fused backward.

Peak memory p * M_B on rank 0; bubble (p-1)(T_F+T_B+T_W).

``one_f_one_b_split`` is the same order with each backward split into B then W at once: never
slower than 1F1B, because B's gradient leaves for the previous rank before W runs.
"""

from ..actions import Action, Op
from ..costs import CostModel


def one_f_one_b(cost: CostModel, m: int) -> list[list[Action]]:
    """1F1B's order on each rank, with fused backwards."""
    p = cost.num_ranks
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(r, Op.F, j) for j in range(warmup)]
        for j in range(m - warmup):
            row += [Action(r, Op.F, warmup + j), Action(r, Op.BW, j)]
        row += [Action(r, Op.BW, j) for j in range(m - warmup, m)]
        ranks.append(row)
    return ranks


def one_f_one_b_split(cost: CostModel, m: int) -> list[list[Action]]:
    """1F1B's order with each backward split into B then W."""
    return [[x for a in row for x in _split(a)] for row in one_f_one_b(cost, m)]


def _split(a: Action) -> list[Action]:
    return [Action(a.stage, Op.B, a.mb), Action(a.stage, Op.W, a.mb)] if a.op is Op.BW else [a]
