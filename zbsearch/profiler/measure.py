"""Time F, B, W and the fused backward BW of one stage and measure the activation memory.

The passes are the runtime's own (``zbsearch.runtime.split``), so the profile times
exactly what a schedule will run, graph analysis of the B/W split included. Each repetition is
one microbatch: F, then B from the gradient the next stage would send (1 for a loss), then W
(on a first stage twice: its W runs plain or deferred, whichever measures faster); then F
again and one fused BW, which is what GPipe / 1F1B run and costs less than B + W (no
split analysis, one autograd call), so a schedule that fuses is predicted at what it runs. That
second F is timed too (``t_ff``): the forward of a microbatch whose backward is fused sets up
no deferral for a split and costs a little less than the split one.

With ``recompute``, each repetition also runs F checkpointed (``runtime.recompute``) and its
recompute pass R, then B and W: their times (``t_fc``, ``t_r``) and what the checkpointed F keeps
(``m_fc``: the stage's inputs and the generators' state, as the runtime keeps them); then F
checkpointed again and R as it runs before a fused backward (the plain forward), then BW:
its time (``t_rf``). Where the stage declares modules for selective recomputation
(``runtime.selective``), also F checkpointed selectively and its RS pass, then B and W:
``t_fs``, ``t_rs`` and what that F keeps (``m_fs``).

These repetitions time each pass alone. Under torchrun the profiler also times the passes inside
steps of the runtime and costs them at those times (``in_step``, ``StageMeasurement.cost``).

Clocks: on CPU ``perf_counter`` around each pass; on CUDA events on the current stream, read
after the last repetition. No synchronisation comes between repetitions: in a training step the
host queues a pass while the device still runs the one before, and after a synchronisation the
device would wait for the host to launch the next pass, a wait the step does not have (a split
F, whose deferral costs the host more than a fused one's, was timed at the host's speed).

Memory: on CPU the bytes of the tensors saved for backward (the runtime's activation meter,
which counts each storage once); on CUDA the allocator's change over each pass, once the first
repetitions have created the parameter gradients. B's input gradients are dropped before
measuring, as the runtime sends them on. m_w is taken as -(m_f + m_b), since what F allocates
B and W free; on CUDA what the allocator still holds after W is recorded as the residual.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.clock import DeviceClock
from ..formats.profile import MIN_TIME_MS, StageCost
from ..runtime.memory import ActivationMeter
from ..runtime.recompute import checkpointed_forward, recompute
from ..runtime.selective import Selection, recompute_selected, selected_modules
from ..runtime.split import backward_full, backward_in_w, backward_input, backward_weight, forward_pass
from ..tolerances import negligible
from .settings import cpu_cores

__all__ = ["Stats", "StageMeasurement", "measure_stage", "disturbances", "SPREAD_LIMIT"]

# A pass whose half interquartile range exceeds this share of its median was disturbed while
# being timed (other processes, frequency changes): its median is not to be trusted to 5%.
SPREAD_LIMIT = 0.10


@dataclass(frozen=True)
class Stats:
    """Median, quartiles and mean of repeated timings, in ms."""

    median: float
    q1: float
    q3: float
    mean: float

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        """The statistics of ``samples`` (at least 2); the median floored at ``MIN_TIME_MS``."""
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(max(statistics.median(samples), MIN_TIME_MS), q1, q3, statistics.fmean(samples))

    def record(self) -> dict:
        """As the profile records it (``Quartiles``)."""
        return {"median": self.median, "q1": self.q1, "q3": self.q3, "mean": self.mean}


@dataclass(frozen=True)
class StageMeasurement:
    """What ``measure_stage`` found for one stage: each pass's times, memory, output size."""

    f: Stats
    b: Stats
    w: Stats
    bw: Stats
    ff: Stats  # the forward of a microbatch whose backward is fused
    m_f: float  # bytes
    m_b: float
    memory_residual: float
    output_bytes: int  # what the stage sends to the next one per microbatch
    deferred_first: bool = False  # a first stage whose W runs deferred (f, b, w are that way's)
    not_taken: tuple[Stats, Stats, Stats] | None = None  # a first stage's F, B, W the other way
    fc: Stats | None = None  # the checkpointed forward (measured with ``recompute``)
    r: Stats | None = None  # the recompute pass
    m_fc: float | None = None  # bytes the checkpointed forward keeps
    fs: Stats | None = None  # the selectively checkpointed forward (``recompute``, a stage that selects)
    rs: Stats | None = None  # its selective recompute pass
    m_fs: float | None = None  # bytes the selectively checkpointed forward keeps
    rf: Stats | None = None  # the recompute pass before a fused backward
    # the passes as the runtime's steps ran them (``in_step``): t_f, t_b, t_w, t_ff, t_bw -> times
    in_step: dict[str, Stats] | None = None

    def cost(self, unit: bool = False) -> StageCost:
        """The stage's costs as the profile holds them: each pass at its mean, m_w balancing m_f + m_b.

        Recomputation is offered where its checkpointed forward keeps no more than a plain one
        (a tiny stage's may keep more: the generators' state outweighs its activations). For a
        ``unit`` of a per-layer profile, what a fully checkpointed forward keeps is capped at m_f
        instead: a stage of several units keeps its input and the state, which
        ``planner.compose`` rebuilds from there.

        Where the passes were also timed inside steps (``in_step``), each pass costs its
        repetitions' mean times how much slower its median ran in the steps than in the
        repetitions: what a schedule's steps run, the occasional slow pass included as the
        repetitions saw it, and a burst of load on the few steps' passes resisted as a median
        does. A recompute pass, which the steps do not run, is a forward run again: it is scaled
        as the stage's forward (F, or FF before a fused backward) was."""
        steps = self.in_step or {}
        timed = {"t_f": self.f, "t_b": self.b, "t_w": self.w, "t_bw": self.bw, "t_ff": self.ff}
        times = {k: _cost(st) * (steps[k].median / st.median if k in steps else 1.0) for k, st in timed.items()}
        f_scale = times["t_f"] / _cost(self.f)
        ff_scale = times["t_ff"] / _cost(self.ff)
        rc: dict[str, float] = {}
        if self.fc is not None and self.r is not None and self.m_fc is not None and (unit or self.m_fc <= self.m_f):
            rc.update({"t_fc": _cost(self.fc) * f_scale, "t_r": _cost(self.r) * f_scale, "m_fc": min(self.m_fc, self.m_f),
                       **({} if self.rf is None else {"t_rf": _cost(self.rf) * ff_scale})})
        if self.fs is not None and self.rs is not None and self.m_fs is not None and self.m_fs <= self.m_f:
            rc.update({"t_fs": _cost(self.fs) * f_scale, "t_rs": _cost(self.rs) * f_scale, "m_fs": self.m_fs})
        return StageCost(
            **times, m_f=self.m_f, m_b=self.m_b, m_w=-(self.m_f + self.m_b), deferred_first=self.deferred_first, **rc,
        )

    def record(self) -> dict:
        """The spread of every pass, as the profile's ``measured.stages`` records it."""
        out = {
            "t_f": self.f.record(), "t_b": self.b.record(), "t_w": self.w.record(), "t_bw": self.bw.record(),
            "t_ff": self.ff.record(), "memory_residual": self.memory_residual, "output_bytes": self.output_bytes,
        }
        if self.fc is not None and self.r is not None:
            out.update({"t_fc": self.fc.record(), "t_r": self.r.record()})
        if self.rf is not None:
            out["t_rf"] = self.rf.record()
        if self.fs is not None and self.rs is not None:
            out.update({"t_fs": self.fs.record(), "t_rs": self.rs.record()})
        if self.in_step:
            out["in_step"] = {k: st.record() for k, st in self.in_step.items()}
        if self.not_taken is not None:
            way = "plain" if self.deferred_first else "deferred"
            out["not_taken"] = {"w": way, **{k: st.record() for k, st in zip(("t_f", "t_b", "t_w"), self.not_taken)}}
        return out


def _cost(st: Stats) -> float:
    """What a pass costs a schedule: its mean, not its median. A step is a sum of passes and
    pays the occasional slow one (a collection, an interrupt), which a median leaves out."""
    return max(st.mean, MIN_TIME_MS)


def measure_stage(
    module: nn.Module,
    inputs: tuple,
    post: Callable | None,
    device: torch.device,
    warmup: int,
    repeat: int,
    tick: Callable[[], None] | None = None,
    recompute_too: bool = False,
    selective: str | None = "attention",
) -> StageMeasurement:
    """``warmup`` untimed then ``repeat`` timed repetitions of F, B, W, and F, BW on ``inputs``.

    A first stage, whose W runs its whole backward, is timed both ways its W can run (one plain
    backward, or deferred: the split's fast path, see ``zbsearch.runtime.split``), in
    alternating order, and keeps the way whose F + B + W costs less; the runtime follows the
    profile's choice. Which is faster depends on the layers and the device (``bench/split.py``
    measures both). ``recompute_too``: also the checkpointed F and its recompute pass (module),
    and, where the stage declares modules in the mode ``selective`` (``runtime.selective``; None:
    none), the selectively checkpointed F and its RS pass."""
    clock = DeviceClock(device)
    meter = ActivationMeter()

    def live() -> float:
        return float(torch.cuda.memory_allocated(device)) if clock.cuda else float(meter.bytes)

    ways = (False, True) if backward_in_w(module, inputs) else (False,)
    split: dict[bool, list[tuple[float, float, float]]] = {d: [] for d in ways}  # F, B, W per way
    mem: dict[bool, list[tuple[float, float, float]]] = {d: [] for d in ways}
    fused: list[tuple[float, float]] = []  # BW, FF
    timed: list[tuple[dict, tuple]] = []  # per timed repetition: its marks, read after the last one
    grads = None
    output_bytes = 0
    for rep in range(warmup + repeat):
        marks = {}
        for deferred in ways if rep % 2 == 0 else ways[::-1]:
            a0, e0 = live(), clock.mark()
            fp = forward_pass(module, inputs, post=post, meter=meter, deferred_first=deferred)
            e1, a1 = clock.mark(), live()
            if grads is None:  # first (warm-up) repetition: what the next stage would send back
                grads = [torch.ones_like(o) if o.requires_grad else None for o in fp.outputs]
                output_bytes = sum(o.nbytes for o in fp.outputs)
            input_grads, weight_pass = backward_input(fp, grads)
            e2 = clock.mark()
            del input_grads
            a2 = live()
            backward_weight(weight_pass)
            e3, a3 = clock.mark(), live()
            del fp
            marks[deferred] = (e0, e1, e2, e3, (a1 - a0, a2 - a1, a3 - a0))
        assert grads is not None  # set by the first split pass
        e3f = clock.mark()  # freeing the split pass's graph is no part of the fused forward
        fwd = forward_pass(module, inputs, split=False, post=post, meter=meter)
        e4 = clock.mark()
        backward_full(fwd, grads)
        e5 = clock.mark()
        del fwd
        if rep >= warmup:
            timed.append((marks, (e3f, e4, e5)))
        if tick is not None:
            tick()
    clock.sync()  # once, after the last repetition (see the module)
    for marks, (e3f, e4, e5) in timed:
        for deferred, (e0, e1, e2, e3, m) in marks.items():
            split[deferred].append((clock.ms(e0, e1), clock.ms(e1, e2), clock.ms(e2, e3)))
            mem[deferred].append(m)
        fused.append((clock.ms(e4, e5), clock.ms(e3f, e4)))
    stats: dict[bool, tuple[Stats, Stats, Stats]] = {}
    for d in ways:
        f, b, w = (Stats.of(list(col)) for col in zip(*split[d]))
        stats[d] = (f, b, w)
    deferred = min(ways, key=lambda d: sum(_cost(st) for st in stats[d]))
    f, b, w = stats[deferred]
    bw, ff = (Stats.of(list(col)) for col in zip(*fused))
    m_f, m_b, residual = (statistics.median(col) for col in zip(*mem[deferred]))
    m_f = max(m_f, 0.0)
    fc = r = rf = m_fc = None
    if recompute_too:
        assert grads is not None
        fc, r, rf, m_fc = _measure_recompute(module, inputs, post, device, clock, meter, live, grads, deferred, warmup,
                                             repeat)
    fs = rs = m_fs = None
    chosen = selected_modules(module, selective) if recompute_too and selective is not None else []
    if chosen:
        assert grads is not None
        fs, rs, m_fs = _measure_selective(module, chosen, inputs, post, device, clock, meter, live, grads, deferred,
                                          warmup, repeat)
    return StageMeasurement(f, b, w, bw, ff, m_f, max(min(m_b, 0.0), -m_f), residual, output_bytes,
                            deferred, stats[not deferred] if len(ways) == 2 else None, fc, r, m_fc, fs, rs, m_fs, rf)


def _measure_recompute(module, inputs, post, device, clock, meter, live, grads, deferred: bool, warmup: int,
                       repeat: int) -> tuple[Stats, Stats, Stats, float]:
    """Times of the checkpointed F and its recompute pass (before B and W, and before a fused
    BW), and what the checkpointed F keeps (bytes, median), over ``warmup`` untimed and
    ``repeat`` timed repetitions."""
    marks: list[tuple] = []
    kept: list[float] = []
    for rep in range(warmup + repeat):
        a0, e0 = live(), clock.mark()
        outs, ckpt = checkpointed_forward(module, inputs, post=post, meter=meter, device=device)
        e1, a1 = clock.mark(), live()
        del outs
        fp = recompute(ckpt, module, post=post, meter=meter, deferred_first=deferred)
        e2 = clock.mark()
        input_grads, weight_pass = backward_input(fp, grads)
        del input_grads
        backward_weight(weight_pass)
        del fp, weight_pass
        outs, ckpt = checkpointed_forward(module, inputs, post=post, meter=meter, device=device)
        del outs
        e3 = clock.mark()
        fp = recompute(ckpt, module, split=False, post=post, meter=meter)
        e4 = clock.mark()
        backward_full(fp, grads)
        del fp
        if rep >= warmup:
            marks.append((e0, e1, e2, e3, e4))
            kept.append(a1 - a0)
    clock.sync()  # once, after the last repetition (see the module)
    times = [(clock.ms(e0, e1), clock.ms(e1, e2), clock.ms(e3, e4)) for e0, e1, e2, e3, e4 in marks]
    fc, r, rf = (Stats.of(list(col)) for col in zip(*times))
    return fc, r, rf, max(statistics.median(kept), 0.0)


def _measure_selective(module, chosen, inputs, post, device, clock, meter, live, grads, deferred: bool, warmup: int,
                       repeat: int) -> tuple[Stats, Stats, float]:
    """Times of the F checkpointed selectively (the ``chosen`` modules) and its RS pass, and what
    that F keeps (bytes, median), over ``warmup`` untimed and ``repeat`` timed repetitions (each
    then B and W)."""
    marks: list[tuple] = []
    kept: list[float] = []
    for rep in range(warmup + repeat):
        select = Selection(module, chosen, meter, device)
        a0, e0 = live(), clock.mark()
        fp = forward_pass(module, inputs, post=post, meter=meter, deferred_first=deferred, select=select)
        e1, a1 = clock.mark(), live()
        recompute_selected(select, fp.saved)
        e2 = clock.mark()
        input_grads, weight_pass = backward_input(fp, grads)
        del input_grads
        backward_weight(weight_pass)
        del fp, weight_pass
        if rep >= warmup:
            marks.append((e0, e1, e2))
            kept.append(a1 - a0)
    clock.sync()  # once, after the last repetition (see the module)
    times = [(clock.ms(e0, e1), clock.ms(e1, e2)) for e0, e1, e2 in marks]
    fs, rs = (Stats.of(list(col)) for col in zip(*times))
    return fs, rs, max(statistics.median(kept), 0.0)


def disturbances(
    results: list[StageMeasurement], device: torch.device, threads: int, ranks: int,
    links: Sequence[Stats | None] = (),
    host: Sequence[tuple[str, int, Stats]] = (),
) -> list[str]:
    """Why the measured times may not be what the runtime will see, one sentence each: CPU
    threads beyond the cores (in the measurement, or once ``ranks`` processes run at once),
    a busy machine (load average above the cores), passes, measured links (``links``, per
    boundary, None where there is none) and host times per message (``host``: (which end,
    boundary, times)) whose spread is above SPREAD_LIMIT, but for a negligible pass
    (``tolerances.negligible``: a first stage's empty B); and stages where recomputation is not
    offered because its checkpointed forward would keep more than a plain one."""

    found = []
    if device.type == "cpu":
        cores = cpu_cores()
        if threads > cores:
            found.append(f"{threads} torch threads on {cores} cores: the passes were timed while waiting for a core")
        elif threads * ranks > cores:
            found.append(f"{ranks} ranks x {threads} torch threads exceed the {cores} cores: the runtime's passes will "
                         f"wait for a core and run slower than profiled (use --threads {max(1, cores // ranks)})")
        load = os.getloadavg()[0]
        if load > cores:
            found.append(
                f"the machine is busy (1-minute load average {load:.1f} on {cores} cores): times include waiting for a core"
            )
    for s, r in enumerate(results):
        for what, kept in (("full", r.m_fc), ("selective", r.m_fs)):
            if kept is not None and kept > r.m_f:
                found.append(f"stage {s}: a forward checkpointed for {what} recomputation keeps {kept:.0f} bytes, more than "
                             f"a plain forward's {r.m_f:.0f} (the random generators' state outweighs the activations): "
                             f"{what} recomputation is not offered there")
        passes = [("F", r.f), ("B", r.b), ("W", r.w), ("BW", r.bw), ("FF", r.ff), ("FC", r.fc), ("R", r.r), ("RF", r.rf),
                  ("FS", r.fs), ("RS", r.rs)]
        work = r.f.median + r.b.median + r.w.median
        for name, st in ((n, x) for n, x in passes if x is not None and not negligible(x.median, work)):
            spread = (st.q3 - st.q1) / 2 / st.median
            if spread > SPREAD_LIMIT:
                found.append(
                    f"stage {s} {name}: spread ±{spread:.0%} of the median (above {SPREAD_LIMIT:.0%}): the timing was disturbed"
                )
    for b, link in enumerate(links):
        spread = (link.q3 - link.q1) / 2 / link.median if link is not None else 0.0
        if spread > SPREAD_LIMIT:
            found.append(f"link {b} -> {b + 1}: spread ±{spread:.0%} of the median (above {SPREAD_LIMIT:.0%}): "
                         f"the transfer time was disturbed")
    for end, b, st in host:
        # a message's host time is the difference of two timed forwards, small and noisy next to
        # its own median: its spread matters as a share of the forward it was measured against,
        # at either end of the link (both directions' messages are pooled): the shorter one
        ends = [results[s].f.median for s in (b, b + 1) if s < len(results)]
        forward = min(ends) if ends else 0.0
        spread = (st.q3 - st.q1) / 2 / forward if forward > 0 else 0.0
        if spread > SPREAD_LIMIT:
            what = "sending" if end == "send" else "receiving"
            found.append(f"link {b} -> {b + 1}: the host time of {what} a message spread ±{spread:.0%} of the shorter "
                         f"forward at its ends (above {SPREAD_LIMIT:.0%}): t_{end} was disturbed")
    return found
