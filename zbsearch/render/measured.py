"""Reads the runtime's Chrome trace (``zbsearch.trace`` v1) into a measured Gantt panel.

The trace is the runtime's record of when each action really ran: one complete event
(``"ph": "X"``) per action, ``pid`` = rank, ``ts``/``dur`` in µs, ``args`` = stage, op, mb.
Other events (metadata, counters) are ignored, so the same file stays loadable in Perfetto or
chrome://tracing with extra annotations.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..actions import Action, Op
from ..errors import ZbError
from .gantt import Panel, intervals_panel

__all__ = ["load_measured", "with_measured"]

_FORMAT, _VERSION = "zbsearch.trace", 1


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ZbError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ZbError(f"{path}: is a directory, expected a trace JSON file") from None
    except OSError as err:
        raise ZbError(f"{path}: cannot read ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ZbError(f"{path}: not valid JSON ({err})".replace("\n", " ")) from None


def _action(ev: dict, where: str) -> tuple[int, Action, float, float]:
    args = ev.get("args")
    try:
        rank, ts, dur = int(ev["pid"]), float(ev["ts"]), float(ev["dur"])
        action = Action(int(args["stage"]), Op(args["op"]), int(args["mb"]))
    except (KeyError, TypeError, ValueError):
        raise ZbError(f"{where}: expected pid, ts, dur and args with stage, op (F, B, W or BW) and mb") from None
    if dur < 0 or rank < 0 or action.stage < 0 or action.mb < 0:
        raise ZbError(f"{where}: negative pid, dur, stage or mb")
    return rank, action, ts / 1000.0, (ts + dur) / 1000.0


def load_measured(path: str | os.PathLike) -> Panel:
    """The trace as a panel of measured bars; every problem is one ZbError line."""
    p = Path(path)
    data = _read_json(p)
    header = data.get("zbsearch") if isinstance(data, dict) else None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise ZbError(f"{p}: not a zbsearch trace (expected a 'zbsearch' object with format {_FORMAT!r})")
    if header.get("version") != _VERSION:
        raise ZbError(f"{p}: {_FORMAT} version {header.get('version')!r} is not supported (this zbsearch reads version {_VERSION})")
    events = data.get("traceEvents")
    num_ranks = header.get("num_ranks")
    if not isinstance(events, list) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ZbError(f"{p}: expected a 'traceEvents' list and a positive 'zbsearch.num_ranks'")
    rows: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_ranks)]
    for i, ev in enumerate(events):
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        rank, action, start, end = _action(ev, f"{p}: traceEvents[{i}]")
        if rank >= num_ranks:
            raise ZbError(f"{p}: traceEvents[{i}] is on rank {rank} but the trace has {num_ranks} ranks")
        rows[rank].append((action, start, end))
    if not any(rows):
        raise ZbError(f"{p}: the trace holds no actions")
    m = 1 + max(a.mb for row in rows for a, _, _ in row)
    return intervals_panel(str(header.get("schedule_kind", "?")), "measured", m, rows)


def with_measured(predicted: Panel, path: str | os.PathLike) -> tuple[list[Panel], str]:
    """[predicted, measured] panels and a title comparing their spans.

    Refuses a trace whose ranks ran other actions than the schedule's: comparing the spans
    of two different schedules would look plausible and mean nothing."""
    measured = load_measured(path)
    if measured.num_ranks != predicted.num_ranks:
        raise ZbError(f"{path}: the trace has {measured.num_ranks} ranks but the schedule has {predicted.num_ranks}")
    for r, (pr, mr) in enumerate(zip(predicted.rows, measured.rows)):
        want, got = {b.action for b in pr}, {b.action for b in mr}
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
