"""A schedule in torch.distributed.pipelining's compute-only CSV (pure Python, no torch).

torch (>= 2.6) spells actions ``{stage}{op}{microbatch}`` like we do, with other letters for
the backward: its I is our B (input gradient), its W is our W, its B is our BW (full
backward); F is F. One CSV row per rank, one cell per action, which
``_PipelineScheduleRuntime._load_csv`` reads (it inserts the sends and receives itself).
torch has no action for recomputation, nor a way to say that one microbatch's forward runs
checkpointed and another's does not, so a schedule with recompute passes is refused.
"""

from __future__ import annotations

import csv
import io

from ..actions import RECOMPUTES, Op
from ..errors import ZbError
from .schedule import Schedule

__all__ = ["TORCH_LETTERS", "to_torch_csv"]

TORCH_LETTERS = {Op.F: "F", Op.B: "I", Op.W: "W", Op.BW: "B"}


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule's actions as torch's CSV text: one line per rank, torch's letters.

    Raises:
        ZbError: the schedule recomputes (torch's schedules have no recompute action).
    """
    recomputed = sum(a.op in RECOMPUTES for row in schedule.rank_actions for a in row)
    if recomputed:
        raise ZbError(f"torch.distributed.pipelining has no recompute action, and this schedule recomputes "
                      f"{recomputed} forwards; solve with --recompute none for torch, or run it with zbsearch's runtime")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in schedule.rank_actions:
        writer.writerow(f"{a.stage}{TORCH_LETTERS[a.op]}{a.mb}" for a in row)
    return buf.getvalue()
