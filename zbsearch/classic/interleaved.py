"""Interleaved 1F1B (Megatron-LM): v chunks per rank, rank r holds stages r, r+p, ...

Microbatches go through in groups of p: a rank runs a group's forwards on chunk 0, then the
same group on chunk 1, and so on; backwards run the chunks in reverse. Warm-up is
(p - 1 - r) * 2 + (v - 1) * p forwards, then one forward / one fused backward. Needs m to be a
multiple of p (the grouping). Bubble (p-1)(T_F+T_B+T_W)/v at T_comm = 0, with T the per-rank
times; peak activations rise to about (1 + (p-1)/(p*v)) * p * M_B on rank 0.
"""

from ..actions import Action, Op
from ..costs import CostModel
from ..errors import ZbError


def _virtual(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward (or backward) a rank runs."""
    group, pos = divmod(k, p * v)
    chunk = pos // p
    if backward:
        chunk = v - 1 - chunk
    return chunk, group * p + pos % p


def _action(k: int, r: int, p: int, v: int, op: Op) -> Action:
    """Rank r's k-th forward (op F) or backward (op BW) in the interleaved order."""
    chunk, mb = _virtual(k, p, v, op is Op.BW)
    return Action(chunk * p + r, op, mb)


def interleaved_1f1b(cost: CostModel, m: int) -> list[list[Action]]:
    """Interleaved 1F1B on the cost model's chunks per rank.

    Raises:
        ZbError: fewer than 2 chunks per rank, or m not a multiple of the rank count.
    """
    p = cost.num_ranks
    v = cost.num_stages // p
    if v < 2:
        raise ZbError("interleaved 1F1B needs --chunks >= 2 (with 1 chunk it is 1F1B)")
    if m % p:
        raise ZbError(f"interleaved 1F1B needs the number of microbatches ({m}) to be a multiple of p ({p})")
    total = m * v
    ranks = []
    for r in range(p):
        warmup = min(total, (p - 1 - r) * 2 + (v - 1) * p)
        row = [_action(k, r, p, v, Op.F) for k in range(warmup)]
        for k in range(total - warmup):
            row += [_action(warmup + k, r, p, v, Op.F), _action(k, r, p, v, Op.BW)]
        row += [_action(k, r, p, v, Op.BW) for k in range(total - warmup, total)]
        ranks.append(row)
    return ranks
