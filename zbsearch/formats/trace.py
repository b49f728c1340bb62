"""Measured timeline file format (``zbsearch.trace`` v1): a Chrome / Perfetto trace.

The runtime writes one file per step for all ranks: one complete event ("ph": "X") per action,
``pid`` = rank, times in microseconds on one clock for all ranks, from the step's first action.
Chrome's ``about:tracing`` and https://ui.perfetto.dev open it as it is; ``zbsearch`` reads it
back with this model (no torch needed) to draw it beside the simulator's prediction.
``args.activations`` (optional) is the rank's live activation bytes after the action. Where the
pipeline is one data-parallel replica of several, ``zbsearch.reductions`` holds each rank's
gradient reductions, and with sharded stages ``zbsearch.gathers`` its parameter gathers (both
optional: a trace without them, written by older versions too, loads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..actions import Action, Op
from ..errors import ZbError
from .fileio import read_json, validation_message, write_model

__all__ = ["TraceArgs", "TraceEvent", "TraceInfo", "Trace", "load_trace", "save_trace"]


class TraceArgs(BaseModel):
    """The action an event times, and the rank's live activations after it."""

    model_config = ConfigDict(extra="allow")

    stage: int = Field(ge=0)
    op: Op
    mb: int = Field(ge=0)
    activations: float | None = Field(default=None, description="live activation bytes on the rank after the action")


class TraceEvent(BaseModel):
    """One action as it ran: a complete event of the Chrome trace format."""

    model_config = ConfigDict(extra="allow")

    name: str
    ph: Literal["X"] = "X"
    pid: int = Field(ge=0, description="rank")
    tid: int = 0
    ts: float = Field(description="start, microseconds from the step's first action on any rank")
    dur: float = Field(ge=0, description="duration, microseconds")
    args: TraceArgs

    @property
    def action(self) -> Action:
        """The action this event times."""
        return Action(self.args.stage, self.args.op, self.args.mb)


class TraceInfo(BaseModel):
    """The ``zbsearch`` block: the format's name and version, the schedule kind and its ranks."""

    model_config = ConfigDict(extra="allow")

    format: Literal["zbsearch.trace"] = "zbsearch.trace"
    version: Literal[1] = 1
    schedule_kind: str
    num_ranks: int = Field(ge=1)
    reductions: list[list[tuple[int, float, float]]] | None = Field(
        None, description="per rank, its data-parallel gradient reductions: (stage, start, end) in microseconds from "
        "the step's first action, end when it completed (host tensors: as the group completed it; device tensors: "
        "when the rank first saw it complete, between passes); absent without replicas")
    gathers: list[list[tuple[int, float, float, float]]] | None = Field(
        None, description="per rank, the parameter gathers of its sharded stages: (stage, start, end, bytes), times in "
        "microseconds from the step's first action (a gather issued at the step's start before it starts below 0), "
        "start when issued, end when the rank first saw it complete (between passes, or waiting before the stage's "
        "first pass); bytes the parameters it brings; absent without sharded stages")


class Trace(BaseModel):
    """One measured step of a schedule on every rank (``zbsearch.trace`` v1); read it with
    ``load_trace``."""

    model_config = ConfigDict(extra="allow")

    traceEvents: list[TraceEvent]
    displayTimeUnit: Literal["ms"] = "ms"
    zbsearch: TraceInfo

    def rank_events(self) -> list[list[TraceEvent]]:
        """Events per rank, in start order."""
        rows: list[list[TraceEvent]] = [[] for _ in range(self.zbsearch.num_ranks)]
        for ev in self.traceEvents:
            rows[ev.pid].append(ev)
        for row in rows:
            row.sort(key=lambda e: e.ts)
        return rows

    def span_ms(self) -> list[float]:
        """Per rank: end of its last action minus start of its first, in ms."""
        return [((r[-1].ts + r[-1].dur) - r[0].ts) / 1e3 if r else 0.0 for r in self.rank_events()]

    def makespan_ms(self) -> float:
        """The first start to the last end on any rank, in ms."""
        if not self.traceEvents:
            return 0.0
        return (max(e.ts + e.dur for e in self.traceEvents) - min(e.ts for e in self.traceEvents)) / 1e3


def load_trace(path: str | os.PathLike) -> Trace:
    """The trace's actions; every problem is one ZbError line.

    Only complete events (``"ph": "X"``, the default) are actions: metadata or counters that
    other tools add are skipped, so an annotated file still loads. Problems name the event by
    its index in the file.
    """
    p = Path(path)
    data = read_json(p)
    info = data.get("zbsearch") if isinstance(data, dict) else None
    if not isinstance(info, dict) or info.get("format") != "zbsearch.trace":
        raise ZbError(f"{p}: not a zbsearch trace (no \"zbsearch\": {{\"format\": \"zbsearch.trace\"}} block)")
    assert isinstance(data, dict)  # info came from it
    if info.get("version") != 1:
        raise ZbError(f"{p}: zbsearch.trace version {info.get('version')!r} is not supported (this zbsearch reads version 1)")
    raw = data.get("traceEvents")
    if not isinstance(raw, list):
        raise ZbError(f"{p}: expected a 'traceEvents' list")
    events: list[tuple[int, TraceEvent]] = []
    for i, ev in enumerate(raw):
        if isinstance(ev, dict) and ev.get("ph", "X") == "X":
            try:
                events.append((i, TraceEvent.model_validate(ev)))
            except ValidationError as err:
                raise ZbError(f"{p}: traceEvents[{i}].{validation_message(err)}") from None
    try:
        trace = Trace.model_validate({**data, "traceEvents": [ev for _, ev in events]})
    except ValidationError as err:
        raise ZbError(f"{p}: {validation_message(err)}") from None
    for i, ev in events:
        if ev.pid >= trace.zbsearch.num_ranks:
            raise ZbError(f"{p}: traceEvents[{i}] is on rank {ev.pid} but the trace has {trace.zbsearch.num_ranks} ranks")
    return trace


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write ``trace`` as JSON to ``path``, atomically; the path written."""
    return write_model(trace, path)
