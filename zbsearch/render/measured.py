"""The runtime's Chrome trace (``zbsearch.trace`` v1) as a measured Gantt panel.

The trace is the runtime's record of when each action really ran; ``zbsearch.formats.trace``
reads it (and skips events other than actions, so the same file stays loadable in Perfetto or
chrome://tracing with extra annotations).
"""

from __future__ import annotations

import os

from ..errors import ZbError
from ..formats.trace import load_trace
from .gantt import Panel, intervals_panel

__all__ = ["load_measured", "with_measured"]


def load_measured(path: str | os.PathLike) -> Panel:
    """The trace as a panel of measured bars; every problem is one ZbError line."""
    trace = load_trace(path)
    rows = [[(e.action, e.ts / 1e3, (e.ts + e.dur) / 1e3) for e in row] for row in trace.rank_events()]
    if not trace.traceEvents:
        raise ZbError(f"{path}: the trace holds no actions")
    m = 1 + max(e.args.mb for e in trace.traceEvents)
    return intervals_panel(trace.zbsearch.schedule_kind, "measured", m, rows)


def with_measured(predicted: Panel, path: str | os.PathLike) -> tuple[list[Panel], str]:
    """[predicted, measured] panels and a title comparing their spans.

    Refuses a trace whose ranks ran other actions than the schedule's: comparing the spans
    of two different schedules would look plausible and mean nothing."""
    measured = load_measured(path)
    if measured.num_ranks != predicted.num_ranks:
        raise ZbError(f"{path}: the trace has {measured.num_ranks} ranks but the schedule has {predicted.num_ranks}")
    for r, (pr, mr) in enumerate(zip(predicted.rows, measured.rows)):
        want, got = {a for b in pr for a in b.actions}, {a for b in mr for a in b.actions}
        if want != got:
            extra, missing = sorted(got - want), sorted(want - got)
            what = f"ran {extra[0]}, which the schedule does not have there" if extra else f"never ran {missing[0]}"
            raise ZbError(f"{path}: not a trace of this schedule: rank {r} {what}")
    ratio = measured.span / predicted.span - 1 if predicted.span > 0 else 0.0
    title = (
        f"{predicted.kind}  p={predicted.num_ranks} m={predicted.num_microbatches}: measured span "
        f"{measured.span:.4g} ms vs predicted {predicted.span:.4g} ms ({ratio:+.1%})"
    )
    return [predicted, measured], title
