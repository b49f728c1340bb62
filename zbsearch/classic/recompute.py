"""The classic orders with full recomputation, as users run them when memory is short.

Megatron's ``--recompute-granularity full`` recomputes every microbatch on every stage, right
before its backward: every F runs checkpointed (keeping the stage input) and an R pass rebuilds
its activations just ahead of the B (or fused BW) that reads them. ``1f1b-recompute`` and
``zb-h1-recompute`` are 1F1B and ZB-H1 run that way: their memory falls to about one
microbatch's activations per rank plus what the checkpointed ones keep, and each rank does
one more forward per microbatch. ``1f1b-split-recompute`` is 1F1B with each backward split into
B then W at once (``1f1b-split``), recomputed the same way: the fair baseline for schedules with
split backwards, whose B sends its gradient back before W runs.
"""

from __future__ import annotations

from ..actions import Action, Op
from ..costs import CostModel
from ..errors import ZbError
from .one_f_one_b import one_f_one_b, one_f_one_b_split
from .zb_h import zb_h1

__all__ = ["recompute_before_backward", "one_f_one_b_recompute", "one_f_one_b_split_recompute", "zb_h1_recompute"]


def recompute_before_backward(cost: CostModel, rows: list[list[Action]]) -> list[list[Action]]:
    """``rows`` with every microbatch recomputed (R) just before its backward (B or BW).

    Raises:
        ZbError: the profile offers no full recomputation on some stage.
    """
    missing = [s for s in range(cost.num_stages) if cost.offer(s, Op.R) is None]
    if missing:
        raise ZbError(f"full recomputation needs the profile's t_r and m_fc on every stage; stage {missing[0]} has none "
                      f"(measure them with zbsearch profile, or write them into the profile)")
    return [[x for a in row for x in ((Action(a.stage, Op.R, a.mb), a) if a.op in (Op.B, Op.BW) else (a,))] for row in rows]


def one_f_one_b_recompute(cost: CostModel, m: int) -> list[list[Action]]:
    """1F1B with every microbatch recomputed just before its fused backward."""
    return recompute_before_backward(cost, one_f_one_b(cost, m))


def one_f_one_b_split_recompute(cost: CostModel, m: int) -> list[list[Action]]:
    """1F1B with split backwards (B, then W at once), every microbatch recomputed just before its B."""
    return recompute_before_backward(cost, one_f_one_b_split(cost, m))


def zb_h1_recompute(cost: CostModel, m: int) -> list[list[Action]]:
    """ZB-H1 with every microbatch recomputed just before its B."""
    return recompute_before_backward(cost, zb_h1(cost, m))
