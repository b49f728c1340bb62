"""Stages whose F, B and W take set times while using almost no CPU (timed emulation).

To benchmark p pipeline ranks on a machine with fewer cores, each pass sleeps for the time
the profile gives it instead of computing. The block still has a real autograd graph with the
two backward paths apart, so any B/W split (ours, or torch.distributed.pipelining's) runs the
right sleeps in the right pass:

    y = Act(x + Weight(w))

``Act`` sleeps T_F in forward and T_B in backward: it is on the activation-gradient path, so
B runs it (on a first stage too: an emulated stage asks for a split first stage, whose B runs
that path, while the split backward leaves a real first stage's whole backward to W, as
torch's runtime does; a real first stage's profile has T_B about 0). ``Weight`` sleeps T_W in backward and leads only to the
parameter, so W runs it. Each pass also holds activation memory as the profile says: Act saves
a buffer of M_B - M_W bytes, freed by B, Weight one of M_W bytes, freed by W. Both are one timed
identity (``_Timed``), Weight with no forward time.

A fused backward (BW: one autograd call for both paths) costs the profile's ``t_bw``, not
t_b + t_w: Weight sees that Act ran in the same autograd call (same graph task) and then sleeps
t_bw - t_b instead of t_w. The forward of that microbatch, which the runtime runs without the
split's deferral (``forward_pass(split=False)``, seen through ``fused_forward()``), sleeps the
profile's t_ff instead of t_f, as ``CostModel.durations`` prices it. A checkpointed forward
sleeps the profile's checkpointed time and a recompute pass (R) the recompute time (seen through
``recompute_mode()``); what a checkpointed emulated forward keeps is its input and the
generators' state, not the profile's ``m_fc``.

A sleep overshoots by the OS's wake-up latency; the overshoot is taken off the next pass's
sleep, so each rank's sleeps add up to the profile's times (see ``_sleep``). The runtime's own
work in each pass (building the graph, the split's bookkeeping, the autograd call) comes on
top, and runs slower after a sleep than in a tight loop (the core has run other processes in
between): an emulated pass costs a little more than its profile says. To predict a run of
emulated stages, profile them as real ones (``zbsearch.profiler.profile_one_device``).

A sleep is not slowed by a reduction running beside it, as a real pass is (the profile's
``reduce_slowdown``, ``zbsearch.reductions``). Where the profile gives a factor above 1, an
emulated pass sleeps in short slices and, for each slice, counts as done only 1/factor of the
time slept while one of its process's reductions is in flight
(``zbsearch.runtime.data_parallel.in_flight``; the factor of the stage being reduced, the
largest where several are): the emulated device slows as the profile says, for as long as the
real reduction runs. The other direction needs nothing: a sleep takes no cores, so a real
reduction beside an emulated pass runs at its own speed, and the profile of emulated stages
measures their ``reduce_stretch`` about 1; a profile's factor above 1 (measured on real
passes) is not reproduced here.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..actions import Op
from ..costs import CostModel
from ..formats.profile import Profile
from .recompute import recompute_mode
from .split import fused_forward

__all__ = ["EmulatedStage", "emulated_stages", "emulated_loss"]


_lag = 0.0  # how much this process's passes have overslept and not yet made up


# Longest slice a slowed pass sleeps before it looks again whether a reduction is in flight (s).
_SLICE = 1e-3


def _sleep(seconds: float) -> None:
    """Sleep ``seconds``, less what earlier passes overslept (OS wake-up latency, which grows
    when ranks outnumber cores), so that a rank's sleeps add up to what the profile says."""
    global _lag
    if seconds <= 0:
        return
    t0 = time.perf_counter()
    if seconds > _lag:
        time.sleep(seconds - _lag)
    _lag = max(0.0, _lag + time.perf_counter() - t0 - seconds)


def _sleep_slowed(seconds: float, slowed: _Slowed) -> None:
    """``_sleep``, at the speed ``slowed`` gives for each slice (at most ``_SLICE``) beside this
    process's reductions in flight."""
    global _lag
    if seconds <= 0:
        return
    left = seconds - _lag  # what is left to do at full speed
    t = time.perf_counter()
    while left > 0:
        factor = slowed.factor()
        time.sleep(min(_SLICE, left * factor))
        now = time.perf_counter()
        left -= (now - t) / factor
        t = now
    _lag = -left


def _pause(seconds: float, slowed: _Slowed | None) -> None:
    """A pass's sleep: slowed beside reductions where the profile says so."""
    if slowed is None:
        _sleep(seconds)
    else:
        _sleep_slowed(seconds, slowed)


class _Slowed:
    """How much slower an emulated stage runs now: the profile's factor of the stage whose
    reduction is in flight in this process (its own for one standing for any stage), 1 without."""

    def __init__(self, stage: int, factors: tuple[float, ...]) -> None:
        self.stage, self.factors = stage, factors

    def factor(self) -> float:
        from .data_parallel import in_flight

        return max([1.0, *(self.factors[self.stage if s is None else s] for s in in_flight())])


class _Fusion:
    """Which autograd call (graph task) ran one microbatch's Act backward."""

    task: int | None = None


class _Timed(torch.autograd.Function):
    """The identity, sleeping ``t_fwd`` in forward and ``t_bwd`` in backward, with ``nbytes``
    saved for backward in between. Act (``fused`` None) notes its autograd call in ``fusion``;
    Weight sleeps ``fused`` instead of ``t_bwd`` when it runs in that same call."""

    @staticmethod
    def forward(ctx, x, t_fwd, t_bwd, nbytes, fusion, fused, slowed):
        _pause(t_fwd, slowed)
        ctx.save_for_backward(torch.empty(nbytes, dtype=torch.uint8, device=x.device))
        ctx.t_bwd, ctx.fusion, ctx.fused, ctx.slowed = t_bwd, fusion, fused, slowed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        task = torch._C._current_graph_task_id()
        if ctx.fused is None:
            ctx.fusion.task = task
            _pause(ctx.t_bwd, ctx.slowed)
        else:
            _pause(ctx.fused if ctx.fusion.task == task else ctx.t_bwd, ctx.slowed)
        return grad, None, None, None, None, None, None


class _Gradient(torch.autograd.Function):
    """The identity on the weight; in backward (W's path) it hands the stage's ``ballast``
    parameter a gradient of its full size, as a real stage's W completes its parameters'
    gradients: a zero tensor kept for the purpose, so that producing it costs no time the
    profile does not count (a real W's accumulation is inside its measured t_w)."""

    @staticmethod
    def forward(ctx, weight, stage):
        ctx.stage = stage
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        ballast = ctx.stage.ballast
        if ballast.grad is None:
            ballast.grad = ctx.stage.zeros
        return grad, None


class EmulatedStage(nn.Module):
    """A stage of ``width`` features whose passes sleep ``t_f``, ``t_b``, ``t_w`` seconds
    (``t_bw`` for a fused backward, None: t_b + t_w; ``t_ff`` for the forward before it, None: t_f;
    ``t_fc`` checkpointed, None: t_f; ``t_r`` for its recompute pass, None: t_f; ``t_rf`` for a
    recompute pass before a fused backward, which runs the plain forward, None: t_r).

    ``b_bytes`` of activations live from F to B, ``w_bytes`` from F to W. ``grad_bytes``: the
    stage's trainable parameters, whose gradients W produces (for data-parallel reductions of a
    real stage's size; the weight W sleeps for is ``width`` floats). ``slowdown``: per stage of
    the placement, how much slower the passes run while that stage's reduction is in flight in
    this process (``stage``: this one's index; empty: never slowed; see the module).
    """

    def __init__(
        self, t_f: float, t_b: float, t_w: float, b_bytes: float = 0, w_bytes: float = 0, width: int = 16,
        t_bw: float | None = None, t_ff: float | None = None, t_fc: float | None = None, t_r: float | None = None,
        t_rf: float | None = None, grad_bytes: float = 0, slowdown: tuple[float, ...] = (), stage: int = 0,
    ) -> None:
        super().__init__()
        self.slowed = _Slowed(stage, tuple(slowdown)) if any(f > 1.0 for f in slowdown) else None
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.t_bw = t_b + t_w if t_bw is None else t_bw
        self.t_ff = t_f if t_ff is None else t_ff
        self.t_fc = t_f if t_fc is None else t_fc
        self.t_r = t_f if t_r is None else t_r
        self.t_rf = self.t_r if t_rf is None else t_rf
        self.b_bytes, self.w_bytes = int(b_bytes), int(w_bytes)
        self.weight = nn.Parameter(torch.zeros(width))
        self.ballast = nn.Parameter(torch.zeros(int(grad_bytes) // 4)) if grad_bytes >= 4 else None
        if self.ballast is not None:  # its gradient, kept: moves with the stage, saved with no state
            self.register_buffer("zeros", torch.zeros_like(self.ballast), persistent=False)

    # A first stage's B runs Act, as the profile says: without this the split backward would
    # leave a first stage's whole backward to W (see ``zbsearch.runtime.split``).
    split_first_stage = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """F: sleep the forward's time and pass ``x`` on; its backward sleeps B's and W's times."""
        fusion = _Fusion()
        weight = self.weight if self.ballast is None else _Gradient.apply(self.weight, self)
        w = _Timed.apply(weight, 0.0, self.t_w, self.w_bytes, fusion, max(self.t_bw - self.t_b, 0.0), self.slowed)  # Weight
        mode = recompute_mode()
        if mode == "checkpointed":
            t_fwd = self.t_fc
        elif mode == "recompute":  # the plain forward before a fused backward, as F
            t_fwd = self.t_rf if fused_forward() else self.t_r
        else:
            t_fwd = self.t_ff if fused_forward() else self.t_f
        return _Timed.apply(x + w, t_fwd, self.t_b, self.b_bytes, fusion, None, self.slowed)  # Act


def emulated_stages(
    profile: Profile,
    stage_to_rank: list[int],
    bytes_per_unit: float = 2**20,
    width: int = 16,
    time_scale: float = 1.0,
    grad_bytes: float = 0,
) -> list[EmulatedStage]:
    """One emulated stage per virtual stage of a placement, timed as the cost model says.

    Times are the profile's milliseconds times ``time_scale`` (0 gives zero-time passes, to
    measure the runtime's own overhead); memory is the profile's units times ``bytes_per_unit``.
    ``grad_bytes``: each stage's parameter bytes, whose gradients W produces (``EmulatedStage``).
    Each stage slows beside a reduction in flight as the profile's ``reduce_slowdown`` says.
    """
    cost = CostModel.from_profile(profile.compute_only(), stage_to_rank)  # the runtime does the messages
    k = cost.num_stages // profile.num_stages  # as the cost model maps the profile's stages
    slowdown = tuple(profile.stages[s // k].reduce_slowdown or 1.0 for s in range(cost.num_stages))
    ms = time_scale / 1e3
    full = [(None, None, None) if (o := cost.offer(s, Op.R)) is None else (o.t_f * ms, o.t_r * ms, o.time(fused=True) * ms)
            for s in range(cost.num_stages)]
    return [
        EmulatedStage(
            cost.t_f[s] * ms, cost.t_b[s] * ms, cost.t_w[s] * ms,
            b_bytes=max(-cost.m_b[s], 0.0) * bytes_per_unit, w_bytes=max(-cost.m_w[s], 0.0) * bytes_per_unit,
            width=width, t_bw=cost.t_bw[s] * ms, t_ff=cost.t_ff[s] * ms,
            t_fc=full[s][0], t_r=full[s][1], t_rf=full[s][2], grad_bytes=grad_bytes, slowdown=slowdown, stage=s,
        )
        for s in range(cost.num_stages)
    ]


def emulated_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A cheap scalar loss for emulated pipelines."""
    return ((output - target) ** 2).mean()
