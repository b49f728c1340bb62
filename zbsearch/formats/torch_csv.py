"""A schedule in torch.distributed.pipelining's compute-only CSV (pure Python, no torch).

torch (>= 2.6) spells actions ``{stage}{op}{microbatch}`` like we do, with other letters for
the backward: its I is our B (input gradient), its W is our W, its B is our BW (full
backward); F is F. One CSV row per rank, one cell per action, which
``_PipelineScheduleRuntime._load_csv`` reads (it inserts the sends and receives itself).
"""

from __future__ import annotations

import csv
import io

from ..actions import Op
from .schedule import Schedule

__all__ = ["TORCH_LETTERS", "to_torch_csv"]

TORCH_LETTERS = {Op.F: "F", Op.B: "I", Op.W: "W", Op.BW: "B"}


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule's actions as torch's CSV text: one line per rank, torch's letters."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in schedule.rank_actions:
        writer.writerow(f"{a.stage}{TORCH_LETTERS[a.op]}{a.mb}" for a in row)
    return buf.getvalue()
