"""Per-action timing on each rank, gathered into one Chrome trace (``zbsearch.formats.trace``).

An action's span covers its compute only: it starts once its inputs have arrived and ends
before its outputs are handed to the network, so gaps in the trace are the pipeline's bubbles
and waits. On CPU the clock is ``perf_counter``; on CUDA, events on the current stream
(``distributed.clock.DeviceClock``, the profiler's clock too), read once at the end of the step against an
event taken at a known ``perf_counter`` time, so timing never synchronises the device mid-step.

No barrier starts a step, so ranks share no start time: ``clock_offset`` measures each rank's
clock against rank 0's once, and every rank's times are put on rank 0's clock. The gathered
trace counts from the step's first action on any rank.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..actions import Action, Op
from ..distributed.clock import DeviceClock
from ..formats.trace import Trace, TraceArgs, TraceEvent, TraceInfo
from .errors import post, wait

__all__ = ["StepTimer", "clock_offset", "gather_trace"]

_OPS = list(Op)


class StepTimer:
    """Start/end of each action of one step on this rank, in µs of rank 0's clock
    (``offset``: this rank's ``perf_counter`` minus rank 0's, in seconds)."""

    def __init__(self, device: torch.device, offset: float) -> None:
        self._clock = DeviceClock(device)
        self._offset = offset
        self.offset = offset  # (also for the host-timed reductions: ``PipelineRuntime.trace``)
        self.rows: list[tuple[Action, float, float, float]] = []  # action, start us, end us, activation bytes

    def start(self) -> None:
        """Forget the previous step's rows."""
        self.rows = []
        self._marks: list = []

    def begin(self) -> None:
        """Mark the start of the next action."""
        self._begin = self._clock.mark()

    def end(self, action: Action, activation_bytes: float) -> None:
        """Mark the end of ``action`` and the activation bytes held after it."""
        self._marks.append((action, self._begin, self._clock.mark(), activation_bytes))

    def finish(self) -> None:
        """Turn the step's marks into rows on rank 0's clock (waits for the device first)."""
        if self._clock.cuda:
            ref = self._clock.mark()
            ref.synchronize()  # the step's events have completed too: they precede it on the stream
            now = time.perf_counter()
            seconds = lambda ev: now - self._clock.ms(ev, ref) / 1e3  # noqa: E731
        else:
            seconds = lambda t: t  # noqa: E731
        us = lambda t: (seconds(t) - self._offset) * 1e6  # noqa: E731
        self.rows = [(a, us(b), us(e), m) for a, b, e, m in self._marks]
        self._marks = []


def clock_offset(rank: int, world: int, group: dist.ProcessGroup | None, timeout: float, rounds: int = 5) -> float:
    """Collective: this rank's ``perf_counter`` minus rank 0's, in seconds.

    NTP's estimate, over CPU messages: rank r pings rank 0 at t1, rank 0 answers with its clock,
    rank r reads t4 when the answer arrives; of a few round trips the shortest is kept, whose
    estimate is off by at most half of it. (The moments ranks leave a barrier are no common
    time: gloo lets some ranks out hundreds of µs before others.) Measured once: clocks of
    different machines drift apart by a few ppm, which over hours shifts ranks against each
    other in the trace, never a rank's own span.
    """
    if world == 1:
        return 0.0
    if "gloo" not in dist.get_backend(group):  # NCCL: the host clocks are compared, so over gloo
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    rank0 = dist.get_global_rank(group, 0) if group is not None else 0
    msg = torch.zeros(1, dtype=torch.float64)
    what = "aligning the trace clocks"
    if rank == 0:
        for r in range(1, world):
            peer = dist.get_global_rank(group, r) if group is not None else r
            for _ in range(rounds):
                _wait(lambda peer=peer: dist.irecv(msg, peer, group=group), rank, timeout, what)
                msg[0] = time.perf_counter()
                _wait(lambda peer=peer: dist.isend(msg, peer, group=group), rank, timeout, what)
        return 0.0
    best = (math.inf, 0.0)  # (round trip, offset)
    for _ in range(rounds):
        answer = post(
            lambda: dist.irecv(msg, rank0, group=group), f"rank {rank}: {what}"
        )  # posted first, so rank 0's answer leaves at once
        t1 = time.perf_counter()
        _wait(lambda: dist.isend(torch.zeros(1, dtype=torch.float64), rank0, group=group), rank, timeout, what)
        wait(answer, timeout, f"rank {rank}: {what}")
        t4 = time.perf_counter()
        best = min(best, (t4 - t1, (t1 + t4) / 2 - msg.item()))
    return best[1]


def gather_trace(
    rows: list[tuple[Action, float, float, float]],
    rank: int,
    world: int,
    schedule_kind: str,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
    reductions: list[tuple[int, float, float]] | None = None,
    gathers: list[tuple[int, float, float, float]] | None = None,
    **info,
) -> Trace | None:
    """Collective: every rank's rows to rank 0 of the group, as one trace (None on other ranks).
    ``reductions``: this rank's (stage, start us, end us) on rank 0's clock, where the pipeline
    is one replica of several (then every rank gives them); ``gathers``: likewise its sharded
    stages' parameter gathers (stage, start us, end us, bytes)."""
    table = [[a.stage, _OPS.index(a.op), a.mb, b, e, m] for a, b, e, m in rows]
    per_rank = _gather_rows(table, 6, rank, world, group, device, timeout, "gathering the trace")
    lanes = fetched = None  # every rank gives them or none does (each holds a replica of its stages, or none)
    if reductions is not None:
        lanes = _gather_rows([list(x) for x in reductions], 3, rank, world, group, device, timeout, "gathering the reductions")
    if gathers is not None:
        fetched = _gather_rows([list(x) for x in gathers], 4, rank, world, group, device, timeout, "gathering the gathers")
    if per_rank is None:  # not rank 0
        return None
    t0 = min((row[3] for rows_r in per_rank for row in rows_r), default=0.0)  # the step's first start
    if lanes is not None:
        info["reductions"] = [[(int(s), b - t0, e - t0) for s, b, e in lane] for lane in lanes]
    if fetched is not None:
        info["gathers"] = [[(int(s), b - t0, e - t0, n) for s, b, e, n in lane] for lane in fetched]
    events = []
    for r, rows_r in enumerate(per_rank):
        for stage, op, mb, b, e, m in rows_r:
            a = Action(int(stage), _OPS[int(op)], int(mb))
            args = TraceArgs(stage=a.stage, op=a.op, mb=a.mb, activations=m)
            events.append(TraceEvent(name=str(a), pid=r, ts=b - t0, dur=max(e - b, 0.0), args=args))
    return Trace(traceEvents=events, zbsearch=TraceInfo(schedule_kind=schedule_kind, num_ranks=world, **info))


def _gather_rows(rows: list[list[float]], width: int, rank: int, world: int, group: dist.ProcessGroup | None,
                 device: torch.device, timeout: float, what: str) -> list[list[list[float]]] | None:
    """Collective: every rank's rows of ``width`` numbers to rank 0 (None on other ranks)."""
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _wait(lambda: dist.all_gather(counts, torch.tensor([len(rows)], device=device), group=group, async_op=True),
          rank, timeout, what)
    longest = max(1, max(int(c.item()) for c in counts))
    padded = torch.zeros(longest, width, dtype=torch.float64, device=device)
    if rows:
        padded[: len(rows)] = torch.tensor(rows, dtype=torch.float64).to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    _wait(lambda: dist.all_gather(parts, padded, group=group, async_op=True), rank, timeout, what)
    if rank != 0:
        return None
    return [part[: int(n.item())].tolist() for part, n in zip(parts, counts)]


def _wait(issue, rank: int, timeout: float, what: str) -> None:
    """Issue a collective or point-to-point op and wait for it (errors: ``errors.post``/``wait``)."""
    where = f"rank {rank}: {what}"
    wait(post(issue, where), timeout, where)
