"""Pass times inside pipeline steps: the runtime runs a few steps and its own trace times them.

``measure_stage`` times a stage's passes one microbatch at a time, back to back, on one input.
A training step runs the same passes otherwise: several microbatches in flight on other inputs,
each rank waiting for its neighbours between passes, messages in transit beside the compute.
On some machines that costs a pass more than the profiler's repetitions see (on a shared VM,
data not touched for a few milliseconds is partly gone from the caches when the next pass
reads it), and a prediction from the repetitions alone comes out short on every schedule.

So each round of ``profile_distributed`` also runs the stages in the runtime (``PipelineRuntime``)
over a textbook order of the profile's placement, 1F1B (ZB-V's order for a V, interleaved 1F1B
for looped pieces) on 2 microbatches per rank, once with every backward split into B and W and
once with every backward fused (BW), and takes each pass's time from the runtime's trace of
the timed steps (``calibration_orders``, ``in_step_times``). Each pass then costs its
repetitions' mean scaled by its median in the steps over its median in the repetitions
(``StageMeasurement.cost``): a few steps' passes are few samples, and a median resists a burst
of load on them. The repetitions' times stay recorded beside the steps'. The orders are built
from uniform placeholder costs, so every rank derives the same ones without talking.

The same traces time the runtime's own work between passes (``action_host_times``): on a rank
whose next action's inputs had all been produced by the time its previous action ended, the
gap between the two is the runtime's host time (handing the outputs on, posting receives,
bookkeeping), not a wait. Less the host time of the messages sent and received in that gap,
which the profile holds apart (``t_send``, ``t_recv``, timed through the same message path),
their mean is the profile's ``t_action``, which the cost model adds to every pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..actions import Action, Op
from ..classic import build_classic
from ..dependencies import action_predecessor_types, remote_input, remote_outputs
from ..formats.profile import Profile, StageCost
from ..formats.schedule import Schedule
from ..formats.trace import Trace
from ..layout import placement as layout_placement
from ..runtime import PipelineRuntime
from .measure import Stats

__all__ = ["IN_STEP_KEYS", "action_host_times", "calibration_orders", "in_step_times", "run_in_steps"]

# the profile's pass times a calibration step measures: which order, which op
IN_STEP_KEYS = {"t_f": ("split", Op.F), "t_b": ("split", Op.B), "t_w": ("split", Op.W),
                "t_ff": ("fused", Op.F), "t_bw": ("fused", Op.BW)}
_MICROBATCHES_PER_RANK = 2


def calibration_orders(stage_to_rank: Sequence[int], deferred_first: bool = False) -> dict[str, Schedule] | None:
    """The two orders the calibration steps run on this placement, ``split`` (F, B, W) and
    ``fused`` (F, BW), or None for a placement with no textbook order (neither one stage per
    rank, nor a V or looped layout of several). Built on uniform placeholder costs with
    ``deferred_first`` (how the runtime runs a first stage's W), so every rank builds the same."""
    owner = list(stage_to_rank)
    ranks = max(owner) + 1
    chunks = len(owner) // ranks
    if chunks * ranks != len(owner):
        return None
    if chunks == 1 and owner == layout_placement(ranks):
        kind, place = "1f1b", None
    elif chunks == 2 and owner == layout_placement(ranks, 2, "v"):
        kind, place = "zb-v", owner
    elif chunks > 1 and owner == layout_placement(ranks, chunks, "looped"):
        kind, place = "interleaved-1f1b", owner
    else:
        return None
    stage = StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5)
    placeholder = Profile(name="in-step", memory_unit="activations", placement=place,
                          stages=[stage.model_copy(update={"deferred_first": deferred_first and s == 0})
                                  for s in range(len(owner))])
    m = _MICROBATCHES_PER_RANK * ranks
    base = build_classic(kind, placeholder, m)
    out = {}
    for way, rows in (("split", _split(base.rank_actions)), ("fused", _fused(base.rank_actions))):
        out[way] = Schedule.build(f"{kind} {way} (in-step)", placeholder, m, owner, rows)
    return out


def _split(rows: list[list[Action]]) -> list[list[Action]]:
    """Every fused backward as B then W."""
    return [[x for a in row for x in ((Action(a.stage, Op.B, a.mb), Action(a.stage, Op.W, a.mb))
                                      if a.op is Op.BW else (a,))] for row in rows]


def _fused(rows: list[list[Action]]) -> list[list[Action]]:
    """Every split backward as one BW where its B was (its W dropped)."""
    return [[Action(a.stage, Op.BW, a.mb) if a.op is Op.B else a for a in row if a.op is not Op.W] for row in rows]


def run_in_steps(
    orders: dict[str, Schedule], stages: dict[int, nn.Module], microbatch: tuple, loss_fn: Callable | None, target,
    steps: int, *, group: dist.ProcessGroup | None, device: torch.device, timeout: float, keep_heap: bool,
) -> dict[str, list[Trace]] | None:
    """Collective: one untimed then ``steps`` timed steps of each order on this rank's ``stages``,
    every microbatch a copy of ``microbatch`` (targets of ``target``); the timed steps' traces per
    order on rank 0 of ``group`` (None elsewhere). Without ``loss_fn`` the last stage's backward
    starts from the sum of its outputs, as from any scalar."""
    traces: dict[str, list[Trace]] = {}
    for way, schedule in orders.items():
        m = schedule.num_microbatches
        last = schedule.num_stages - 1
        batch = tuple(torch.cat([t] * m) for t in microbatch) if 0 in stages else None
        loss = loss_fn if loss_fn is not None else _sum
        targets = _repeat(target, m) if last in stages else None
        got: list[Trace] = []
        with PipelineRuntime(schedule, stages, loss, group=group, device=device, timeout=timeout,
                             keep_heap=keep_heap, check_model=False) as runtime:
            for step in range(steps + 1):
                runtime.step(batch, targets)
                trace = runtime.trace()
                if step and trace is not None:
                    got.append(trace)
        traces[way] = got
    return traces if traces and all(traces.values()) else None


def calibration_steps(repeat: int, orders: dict[str, Schedule]) -> int:
    """Timed steps per order: enough for ``repeat`` samples of every pass of every stage."""
    m = next(iter(orders.values())).num_microbatches
    return max(2, math.ceil(repeat / m))


def in_step_times(traces: dict[str, list[Trace]], num_stages: int) -> list[dict[str, Stats]]:
    """Per stage, the statistics of each of its passes (``IN_STEP_KEYS``) in the traces."""
    out: list[dict[str, Stats]] = []
    for s in range(num_stages):
        row = {}
        for key, (way, op) in IN_STEP_KEYS.items():
            samples = [ev.dur / 1e3 for tr in traces.get(way, []) for ev in tr.traceEvents
                       if ev.args.stage == s and ev.args.op is op]
            if len(samples) >= 2:
                row[key] = Stats.of(samples)
        out.append(row)
    return out


def action_host_times(traces: Sequence[Trace], stage_to_rank: Sequence[int] | None = None,
                      t_send: Sequence[float] = (), t_recv: Sequence[float] = ()) -> list[float]:
    """The runtime's host time between actions in ``traces`` (ms): on each rank, the gap before
    every action but its first whose inputs had all been produced (by the traces' ends, on any
    rank) when its previous action ended, so that nothing but the runtime held the rank. A pass
    run in an overlapped pair starts with its partner: it gives no gap. With the placement
    ``stage_to_rank`` and the host time per message at each boundary (``t_send``, ``t_recv``,
    as the profile holds them), each gap less those of the messages its previous action sent
    and its action received across ranks: what the cost model charges apart."""
    def messages(before: Action, a: Action) -> float:
        if stage_to_rank is None:
            return 0.0
        owner = list(stage_to_rank)
        sent = sum(t_send[t.boundary] for t in remote_outputs(before, owner) if t.boundary < len(t_send))
        got = remote_input(a, owner)
        return sent + (t_recv[got.boundary] if got is not None and got.boundary < len(t_recv) else 0.0)

    out: list[float] = []
    for trace in traces:
        rows = trace.rank_events()
        stages = getattr(trace.zbsearch, "num_stages", None) or 1 + max((ev.args.stage for row in rows for ev in row), default=0)
        done: dict[tuple[int, Op, int], float] = {}  # basic pass -> its end, ms
        for row in rows:
            for ev in row:
                for op in ev.action.parts():
                    done[(ev.action.stage, op, ev.action.mb)] = (ev.ts + ev.dur) / 1e3
        for row in rows:
            for before, ev in zip(row, row[1:]):
                prev, start = (before.ts + before.dur) / 1e3, ev.ts / 1e3
                if start < prev:  # an overlapped pair's second pass
                    continue
                a = ev.action
                ready = max((done.get((s, op, a.mb), math.inf) for s, op in action_predecessor_types(a.stage, a.op, stages)),
                            default=0.0)
                if ready <= prev:
                    out.append(start - prev - messages(before.action, a))
    return out


def _sum(output, _target) -> torch.Tensor:
    """A scalar from a stage's output(s), for a model profiled without a loss."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    return sum((t.sum() for t in outs if t.is_floating_point()), torch.zeros((), device=outs[0].device))


def _repeat(target, m: int):
    """The whole batch's targets: ``target`` m times along dim 0 (a placeholder where there is none)."""
    if isinstance(target, torch.Tensor) and target.dim():
        return torch.cat([target] * m)
    if isinstance(target, tuple) and target and all(isinstance(t, torch.Tensor) and t.dim() for t in target):
        return tuple(torch.cat([t] * m) for t in target)
    return torch.zeros(m)
