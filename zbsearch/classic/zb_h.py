"""ZB-H1 and ZB-H2, the paper's handcrafted zero-bubble schedules, as one rule.

Rank r runs ``warm-up`` forwards, then repeats B(i), W(i - lag), F(next); the W passes it
still owes run at the end. Delaying W by ``lag`` on later ranks is what lets B travel up the
pipeline without waiting for W, so the cool-down gaps of 1F1B are filled with W work.

=========  =======================  =========  =====================  ===============
schedule   warm-up forwards         W lag      bubble (T_comm = 0)    peak activations
=========  =======================  =========  =====================  ===============
ZB-H1      p - r                    r          (p-1)(T_F+T_B-T_W)     p * M_B
ZB-H2      2p - 1 - 2r              2r         (p-1)(T_F+T_B-2T_W)    (2p-1) * M_B
=========  =======================  =========  =====================  ===============

The order is valid for any m >= 1 and any costs; the bubble formulas need m >= p (ZB-H1) or
m >= 2p - 1 (ZB-H2), enough microbatches to fill the warm-up.

The fixed lag assumes comparable stages. With very unequal ones (a heavy W on a middle stage,
few microbatches) holding W back can leave a rank idle that 1F1B would have kept busy; the
``1f1b-split`` kind (``one_f_one_b_split``) is the order that avoids it, under its own name.
"""

from ..actions import Action, Op
from ..costs import CostModel


def zb_h(p: int, m: int, level: int) -> list[list[Action]]:
    """The order of the module's table on ``p`` ranks: ZB-H1 at ``level`` 1, ZB-H2 at 2."""
    ranks = []
    for r in range(p):
        warmup = min(m, (p - r) + (level - 1) * (p - 1 - r))
        lag = level * r
        row = [Action(r, Op.F, j) for j in range(warmup)]
        for i in range(m):
            row.append(Action(r, Op.B, i))
            if i >= lag:
                row.append(Action(r, Op.W, i - lag))
            if warmup + i < m:
                row.append(Action(r, Op.F, warmup + i))
        row += [Action(r, Op.W, j) for j in range(max(0, m - lag), m)]
        ranks.append(row)
    return ranks


def zb_h1(cost: CostModel, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's memory, W delayed by r on rank r."""
    return zb_h(cost.num_ranks, m, 1)


def zb_h2(cost: CostModel, m: int) -> list[list[Action]]:
    """ZB-H2: about twice 1F1B's memory, W delayed by 2r on rank r."""
    return zb_h(cost.num_ranks, m, 2)
