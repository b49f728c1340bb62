"""A schedule in torch.distributed.pipelining's compute-only CSV (pure Python, no torch).

torch (>= 2.6) spells actions ``{stage}{op}{microbatch}`` like we do, with other letters for
the backward: its I is our B (input gradient), its W is our W, its B is our BW (full
backward); F is F. One CSV row per rank, one cell per action, which
``_PipelineScheduleRuntime._load_csv`` reads (it inserts the sends and receives itself).
torch has no action for recomputation, nor a way to say that one microbatch's forward runs
checkpointed and another's does not, so a schedule with recompute passes is refused. An
overlapped pair is one cell in torch's sub-action notation, ``(0F3;5I1)OVERLAP_F_B`` (the
forward first), which ``_Action.from_str`` reads as an OVERLAP_F_B action holding the two.
"""

from __future__ import annotations

import csv
import io

from ..actions import RECOMPUTES, Action, Op
from ..errors import ZbError
from .schedule import Schedule

__all__ = ["TORCH_LETTERS", "TORCH_OVERLAP", "to_torch_csv"]

TORCH_LETTERS = {Op.F: "F", Op.B: "I", Op.W: "W", Op.BW: "B"}
TORCH_OVERLAP = "OVERLAP_F_B"  # torch's computation type of a forward and a backward run overlapped


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule's actions as torch's CSV text: one line per rank, torch's letters, each
    overlapped pair one ``(F;B)OVERLAP_F_B`` cell.

    Raises:
        ZbError: the schedule recomputes (torch's schedules have no recompute action).
    """
    recomputed = sum(a.op in RECOMPUTES for row in schedule.rank_actions for a in row)
    if recomputed:
        raise ZbError(f"torch.distributed.pipelining has no recompute action, and this schedule recomputes "
                      f"{recomputed} forwards; solve with --recompute none for torch, or run it with zbsearch's runtime")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for r, row in enumerate(schedule.rank_actions):
        cells = [_torch(a) for a in row]
        for i in reversed(schedule.pairs(r)):
            cells[i : i + 2] = [f"({cells[i]};{cells[i + 1]}){TORCH_OVERLAP}"]
        writer.writerow(cells)
    return buf.getvalue()


def _torch(a: Action) -> str:
    return f"{a.stage}{TORCH_LETTERS[a.op]}{a.mb}"
