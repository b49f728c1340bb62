"""Per-action timing on each rank, gathered into one Chrome trace (``zbsearch.trace_format``).

An action's span covers its compute only: it starts once its inputs have arrived and ends
before its outputs are handed to the network, so gaps in the trace are the pipeline's bubbles
and waits. On CPU the clock is ``perf_counter``; on CUDA, events on the current stream, read
once at the end of the step, so timing never synchronises the device mid-step. Each rank's
times count from the moment it left the barrier that starts the step.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ..actions import Action, Op
from ..trace_format import Trace, TraceArgs, TraceEvent, TraceInfo
from .errors import PipelineError

__all__ = ["StepTimer", "gather_trace"]

_OPS = list(Op)


class StepTimer:
    """Start/end of each action of one step on this rank."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.rows: list[tuple[Action, float, float, float]] = []  # action, start us, end us, activation bytes

    def start(self) -> None:
        self.rows = []
        self._marks: list = []
        self._t0 = self._mark()

    def _mark(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self) -> None:
        self._begin = self._mark()

    def end(self, action: Action, activation_bytes: float) -> None:
        self._marks.append((action, self._begin, self._mark(), activation_bytes))

    def finish(self) -> None:
        if self._cuda:
            torch.cuda.current_stream().synchronize()
            us = lambda ev: self._t0.elapsed_time(ev) * 1e3  # noqa: E731 - ms to us
        else:
            us = lambda t: (t - self._t0) * 1e6  # noqa: E731
        self.rows = [(a, us(b), us(e), m) for a, b, e, m in self._marks]
        self._marks = []


def gather_trace(
    rows: list[tuple[Action, float, float, float]],
    rank: int,
    world: int,
    schedule_kind: str,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
    **info,
) -> Trace | None:
    """Collective: every rank's rows to rank 0 of the group, as one trace (None on other ranks)."""
    data = torch.tensor([[a.stage, _OPS.index(a.op), a.mb, b, e, m] for a, b, e, m in rows], dtype=torch.float64)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _wait(dist.all_gather(counts, torch.tensor([len(rows)], device=device), group=group, async_op=True), rank, timeout)
    longest = max(int(c.item()) for c in counts)
    padded = torch.zeros(longest, 6, dtype=torch.float64, device=device)
    padded[: len(rows)] = data.reshape(-1, 6).to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    _wait(dist.all_gather(parts, padded, group=group, async_op=True), rank, timeout)
    if rank != 0:
        return None
    events = []
    for r, (part, n) in enumerate(zip(parts, counts)):
        for stage, op, mb, b, e, m in part[: int(n.item())].tolist():
            a = Action(int(stage), _OPS[int(op)], int(mb))
            events.append(TraceEvent(name=str(a), pid=r, ts=b, dur=max(e - b, 0.0), args=TraceArgs(stage=a.stage, op=a.op, mb=a.mb, activations=m)))
    return Trace(traceEvents=events, zbsearch=TraceInfo(schedule_kind=schedule_kind, num_ranks=world, **info))


def _wait(work: dist.Work, rank: int, timeout: float) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as err:
        raise PipelineError(f"rank {rank}: gathering the trace failed or timed out after {timeout:g}s: {err}") from err
