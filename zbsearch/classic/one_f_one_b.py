"""1F1B: p-1-r warm-up forwards on rank r, then one forward / one fused backward.

Peak memory p * M_B on rank 0; bubble (p-1)(T_F+T_B+T_W).
"""

from ..actions import Action, Op


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(r, Op.F, j) for j in range(warmup)]
        for j in range(m - warmup):
            row += [Action(r, Op.F, warmup + j), Action(r, Op.BW, j)]
        row += [Action(r, Op.BW, j) for j in range(m - warmup, m)]
        ranks.append(row)
    return ranks
