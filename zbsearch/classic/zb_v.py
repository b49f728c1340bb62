"""ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r) at 1F1B's memory.

The V puts the first and the last stage on rank 0, so a microbatch's forward goes down the
ranks and comes back up, and its backward does the same: every rank gets work from both
directions and frees activations early. There is no closed rule for the order; like the
paper we build it greedily (``greedy_schedule``): B first, then F while activations stay
within p * M_B on each rank, W to fill what is left. With T_F = T_B = T_W and m >= 2p this
gives zero bubble at p * M_B.
"""

from ..actions import Action
from ..costs import CostModel
from ..greedy import greedy_schedule
from ..schedule import v_placement


def zb_v(cost: CostModel, m: int) -> list[list[Action]]:
    p = cost.num_ranks
    assert list(cost.stage_to_rank) == v_placement(p)
    return greedy_schedule(cost, m, [p * cost.activation_unit(r) for r in range(p)])
