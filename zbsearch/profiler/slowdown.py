"""How much a running reduction and the passes beside it slow each other: each stage's
``reduce_slowdown`` (the passes) and ``reduce_stretch`` (the reduction).

The runtime starts a stage's gradient reduction at its last W and goes on with the passes left
(``zbsearch.runtime.data_parallel``). The collective is not free for them: on a CPU gloo's
threads take cores, caches and memory bandwidth from the passes; on a GPU the communication
kernels take streaming multiprocessors and memory bandwidth. The simulator slows a pass by the
stage's factor while the reduction runs (``zbsearch.reductions``); this module measures it, on
a real data-parallel group, every member at once:

* after ``warmup`` passes, ``repeat`` rounds of: the stage's pass (its forward and whole
  backward on the profiled microbatch, seeded with ones: the loss left out) timed alone and
  timed while the stage's reduction runs beside it (alone first in even rounds, last in odd
  ones, so that what a pass's place in the round does to it cancels); the reduction is the
  runtime's buckets (``GradientReducer.buffers``) all-reduced on the group back to back on a
  thread of their own, so that the lane is busy for the whole pass; the members stop the
  reductions together once every one has timed its pass (a flag reduced with them).

A sample is a round's pass beside the reduction over its pass alone: pairing them keeps a
drift in the machine's load out of the ratio. A pass that ended after its rank's reductions
had stopped is left out. The samples' median is the factor, at least 1.

The same rounds time the reduction's own slowdown (``reduce_stretch``: the collective's threads
or kernels share the cores, or the multiprocessors and memory bandwidth, with the pass): the
lane's first reduction of a round runs before the pass starts (the pass waits for it on every
member), alone, and so does a second one, the one timed alone (the first also waits for every
member's lane to start); those that start and end while the pass runs run beside it. A sample
is the mean of a round's reductions beside the pass over the round's one alone; a round whose
pass held no whole reduction (a reduction longer than the pass) gives none. One reduction per
round more than the pass factor alone needs.

A sharded stage (``fully_shard``) has no all-reduce on its lane but its parameters' gather at
the step's start and its gradients' reduce-scatter after its last W; the simulator slows the
passes beside either by the stage's one factor. Its lane here runs the stage's collectives as
FSDP issues them (``sharded_buffers``): per unit (``shard_units``), an all-gather of each
rank's padded shard into the whole, then a reduce-scatter of the whole back to the shards,
back to back, so the factor is that of the mix a sharded step puts beside its passes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ZbError
from .stages import as_inputs

__all__ = ["LANE_THREAD", "Factors", "stage_pass", "reduction_buffers", "sharded_buffers", "slowdown_samples"]

LANE_THREAD = "zbsearch-reduction-lane"  # the name of the thread that keeps a reduction running
# Reductions a round's lane runs alone before the pass starts: the first waits for the members'
# lanes to start, so the second is the one timed alone (``reduce_stretch``).
ALONE = 2


@dataclass
class Factors:
    """One stage's samples (module docstring): ``passes``, by how much its reduction slowed its
    pass beside it; ``lane``, by how much its pass slowed its reduction beside it."""

    passes: list[float] = field(default_factory=list)
    lane: list[float] = field(default_factory=list)


def stage_pass(module: nn.Module, inputs: tuple) -> Callable[[], None]:
    """The stage's forward and whole backward on ``inputs``, seeded with ones on the outputs
    that need a gradient."""

    def run() -> None:
        outs = [t for t in as_inputs(module(*inputs)) or () if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    return run


def reduction_buffers(module: nn.Module, group: dist.ProcessGroup | None, timeout: float) -> list[torch.Tensor]:
    """Zeros shaped as the buckets the runtime reduces for ``module`` on ``group`` (zeros sum to
    zeros, so repeating the reduction changes nothing)."""
    from ..runtime.data_parallel import GradientReducer

    on = group if group is not None else dist.group.WORLD
    assert on is not None  # the caller joined the default group
    return GradientReducer({0: module}, [0], on, timeout).buffers(0)


def sharded_buffers(units: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]], world: int,
                    device: torch.device) -> list[torch.Tensor]:
    """Zeros shaped as what FSDP gathers and reduce-scatters for a stage sharded over ``world``
    ranks, whose units hold parameters of these shapes and dtypes (``shard_units``): per unit
    and dtype, the whole of every rank's shards (each parameter's first dimension padded to a
    multiple of ``world``, as FSDP pads it), flat."""
    out = []
    for unit in units:
        per_dtype: dict[torch.dtype, int] = {}
        for shape, dtype in unit:
            rows = -(-shape[0] // world) if shape else 1
            per_dtype[dtype] = per_dtype.get(dtype, 0) + rows * math.prod(shape[1:])
        out += [torch.zeros(world * n, dtype=dtype, device=device) for dtype, n in per_dtype.items() if n]
    return out


def slowdown_samples(passes: Sequence[Callable[[], None]], buffers: Sequence[list[torch.Tensor]],
                     group: dist.ProcessGroup | None, repeat: int, warmup: int, timeout: float,
                     device: torch.device | None = None, sharded: bool = False) -> list[Factors]:
    """Collective over ``group``: per stage, the factors by which its reduction (``buffers``)
    running beside its pass (``passes``) slowed the pass, and the pass the reduction (module
    docstring); fewer than ``repeat`` where passes outlasted the reductions, or the reductions
    the passes. ``sharded``: the buffers are a sharded stage's (``sharded_buffers``), each
    all-gathered then reduce-scattered instead."""
    cuda = device is not None and device.type == "cuda"

    def window(run: Callable[[], None]) -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        return t0, time.perf_counter()

    def timed(run: Callable[[], None]) -> float:
        t0, t1 = window(run)
        return (t1 - t0) * 1e3

    out = []
    for run, bufs in zip(passes, buffers):
        for _ in range(warmup):
            run()
        got = Factors()
        for k in range(repeat):
            first = timed(run) if k % 2 == 0 else None  # alone first in even rounds, after in odd ones
            lane = _Lane(bufs, group, sharded)
            dist.barrier(group=group)
            lane.begin(timeout)
            t0, t1 = window(run)
            whole = not lane.stopped.is_set()  # the lane ran for the whole pass
            lane.end(timeout)
            alone = first if first is not None else timed(run)
            if whole:
                got.passes.append((t1 - t0) * 1e3 / alone if alone > 0 else 1.0)
            stretch = lane.stretch(t0, t1)
            if stretch is not None:
                got.lane.append(stretch)
        out.append(got)
    return out


class _Lane:
    """A stage's reduction (``sharded``: its gathers and reduce-scatters) repeated on a thread
    until every member of the group asks it to stop."""

    def __init__(self, buffers: list[torch.Tensor], group: dist.ProcessGroup | None, sharded: bool = False) -> None:
        self.buffers, self.group = buffers, group
        self.shards = [torch.zeros(b.numel() // dist.get_world_size(group), dtype=b.dtype, device=b.device)
                       for b in buffers] if sharded else None
        self.flag = torch.zeros(1, device=buffers[0].device if buffers else "cpu")
        self.started, self.stopped, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.marks: list[float] = []  # when the lane started, then the end of each of its reductions
        self.thread = threading.Thread(target=self._run, name=LANE_THREAD, daemon=True)

    def _run(self) -> None:
        try:
            with torch.no_grad():
                self.marks.append(time.perf_counter())
                while True:
                    if self.shards is None:
                        for b in self.buffers:
                            dist.all_reduce(b, group=self.group)
                    else:  # as FSDP: each unit's shards gathered whole, then its gradients reduce-scattered
                        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
                        for b, part in zip(self.buffers, self.shards):
                            dist.all_gather_into_tensor(b, part, group=self.group)
                            scatter(part, b, group=self.group)
                    self.flag.fill_(1.0 if self.stop.is_set() else 0.0)
                    dist.all_reduce(self.flag, op=dist.ReduceOp.MIN, group=self.group)  # 1 once every member asks
                    stop = self.flag.item() > 0  # waits for the reduction's end, on a GPU too
                    self.marks.append(time.perf_counter())
                    if len(self.marks) > ALONE:  # the pass waits for these, run alone
                        self.started.set()
                    if stop:
                        break
        except BaseException as err:  # re-raised on the measuring thread
            self.error = err
        finally:
            self.stopped.set()
            self.started.set()

    def stretch(self, t0: float, t1: float) -> float | None:
        """The mean of the reductions that ran while a pass ran from ``t0`` to ``t1`` (started
        and ended within) over the last of those that ran alone before the pass (``begin``);
        None where none did."""
        runs = list(zip(self.marks, self.marks[1:]))
        if len(runs) <= ALONE or runs[ALONE - 1][1] > t0:
            return None
        beside = [b - a for a, b in runs[ALONE:] if a >= t0 and b <= t1]
        alone = runs[ALONE - 1][1] - runs[ALONE - 1][0]
        if not beside or alone <= 0:
            return None
        return sum(beside) / len(beside) / alone

    def begin(self, timeout: float) -> None:
        """Start the reductions; return once ``ALONE`` have run on every member."""
        from ..runtime.data_parallel import note_in_flight

        note_in_flight(None, self.stopped.is_set)
        self.thread.start()
        if not self.started.wait(timeout):
            raise ZbError(f"the data-parallel reduction did not complete within {timeout:g} s while timing its slowdown")
        self._check()

    def end(self, timeout: float) -> None:
        """Ask the members to stop and wait for the last reduction."""
        self.stop.set()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise ZbError(f"the data-parallel reductions did not stop within {timeout:g} s after timing their slowdown")
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            raise ZbError(f"the data-parallel reduction failed while timing its slowdown: {self.error}")
