"""Time to pass a stage's outputs to the next rank: measured on the real link, or estimated.

Under torchrun each pair of neighbouring ranks ping-pongs the real boundary tensors and the
one-way time is half the mean round trip (activations go one way, their gradient of the same
size comes back, so one number serves both directions). The mean, not the median: a rank
waiting for a message sleeps in the transport, and waking it is sometimes fast and sometimes
an order of magnitude slower, in runs of either, so a median of a few round trips lands on
one mode or the other, from one profile to the next, while a step, which pays every message
on its critical path, pays the mean. On one device there is no link to time:
two local processes measure latency (a 4-byte message) and bandwidth (a 16 MiB one) on the
transport the runtime would use on this machine, and each boundary is estimated as
latency + bytes / bandwidth. There the fastest round trip counts: the aim is the transport's
own cost, and on a busy machine the two processes often wait for a core, which only adds time.
On a machine with one GPU that transport is the host's (gloo over loopback TCP), far slower
than the GPUs' interconnect of the cluster the profile is for: the estimate then carries a
caveat (a warning in the profile), and the user may give the link instead (``LinkModel.given``,
``zbsearch profile --link-bandwidth``). The profile's ``links`` block says which was done, with
the spread of the timed messages.

Under torchrun each pair also measures what a message costs the ranks' own time while both
compute (``busy_exchange``), through the runtime's own message path and in both directions
(activations, then their gradient with its mask): the sender's call handing it over, the
receiver's posting and collecting of its receive, and what the transfer then takes from the
rank's compute, the profile's ``t_send`` and ``t_recv``. Raw ``isend``/``irecv`` of the
activations alone would miss what the runtime's own calls cost (headers, gradient masks,
tags), which a step pays per message, most of all in ZB-V, which sends twice as many messages
per pass as 1F1B (figures in the profiler's bench report).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import run_local
from ..distributed.timeouts import LINK_ESTIMATE_TIMEOUT_S
from ..errors import ZbError
from ..formats.profile import MIN_TIME_MS
from ..runtime.p2p import ACT, GRAD, P2P, Message
from .measure import Stats

__all__ = ["LinkModel", "pingpong", "exchange_plan", "busy_exchange", "estimate_link"]

_LARGE = 16 * 2**20


@dataclass(frozen=True)
class LinkModel:
    """A link as latency plus bytes over bandwidth: estimated (``estimate_link``) or given by
    the user (``given``)."""

    latency_ms: float
    bandwidth_gb_s: float  # 1e9 bytes per second
    how: str
    # quartiles of the one-way times measured for the estimate, per message ("4 B", "16 MiB")
    spread: dict[str, dict] | None = None
    method: str = "estimated"  # or "given"
    # why the estimate may not be the cluster's link: a warning for the profile (None: none)
    caveat: str | None = None

    @classmethod
    def given(cls, bandwidth_gb_s: float, latency_ms: float = 0.0) -> LinkModel:
        """The link the user gives (``--link-bandwidth``, ``--link-latency``), checked: a
        one-line ZbError for a bandwidth that is not a positive number or a negative latency."""
        if not (math.isfinite(bandwidth_gb_s) and bandwidth_gb_s > 0):
            raise ZbError(f"--link-bandwidth must be a positive number of GB/s, not {bandwidth_gb_s:g}")
        if not (math.isfinite(latency_ms) and latency_ms >= 0):
            raise ZbError(f"--link-latency must be a number of ms, 0 or more, not {latency_ms:g}")
        return cls(latency_ms, bandwidth_gb_s, f"given: {latency_ms:g} ms + bytes at {bandwidth_gb_s:g} GB/s",
                   method="given")

    def time_ms(self, nbytes: float) -> float:
        """One-way time of a message of ``nbytes`` bytes."""
        return self.latency_ms + nbytes / (self.bandwidth_gb_s * 1e6)

    def record(self) -> dict:
        """The profile's ``links`` block for this link."""
        return {"method": self.method, "latency_ms": self.latency_ms, "bandwidth_gb_s": self.bandwidth_gb_s,
                "how": self.how, **({"one_way_spread_ms": self.spread} if self.spread else {})}


def pingpong(
    tensors: list[torch.Tensor], peer: int, lead: bool, group=None, warmup: int = 3, repeat: int = 10,
) -> list[float]:
    """One-way times (ms, half of each round trip) to send ``tensors`` to ``peer``; both ranks
    call it, one leading."""
    cuda = any(t.is_cuda for t in tensors)
    dst = dist.get_global_rank(group, peer) if group is not None else peer
    samples = []
    for rep in range(warmup + repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step in ("send", "recv") if lead else ("recv", "send"):
            for t in tensors:
                (dist.send if step == "send" else dist.recv)(t, dst, group=group)
        if cuda:
            torch.cuda.synchronize()
        if rep >= warmup:
            samples.append((time.perf_counter() - t0) * 1e3 / 2)
    return samples


def exchange_plan(boundaries: list[tuple[int, int, int]], count: int) -> list[Message]:
    """The messages ``busy_exchange`` sends, in the runtime's plan format: per boundary
    (stage, its rank, the next stage's rank), ``count`` activation messages, each followed by
    its gradient coming back."""
    plan: list[Message] = []
    for b, src, dst in boundaries:
        for j in range(count):
            plan.append(Message(ACT, b, j, src, dst, len(plan)))
            plan.append(Message(GRAD, b, j, dst, src, len(plan)))
    return plan


def busy_exchange(
    comm: P2P, boundary: int, tensors: list[torch.Tensor], lead: bool | None, work: Callable[[], object],
    group=None, warmup: int = 2, repeat: int = 10,
) -> dict[str, list[float]]:
    """Time (ms) one message costs this rank while both ranks compute, as in a pipeline's steady
    state, for this rank's end of ``boundary``: the runtime's own message path (``comm``, a
    ``P2P`` on ``exchange_plan``: headers, gradient masks, tags, its waits), activations from the
    stage's rank (``lead``) and their gradient back, so each rank sends one kind and receives
    the other. A sender's time is its ``send`` call, a receiver's its receive posted ahead and
    its ``recv`` after the compute, each plus what the transfer's background work takes from
    that compute (the transport's threads copy the data on the rank's own cores; with as many
    busy ranks as cores, they take it from the passes). Repetitions come in pairs, one with a
    message and one without, each timing the calls around a ``work()`` (the stage's forward);
    a sample is the pair's difference, so the machine's drift cancels, and it can be slightly
    negative from noise. ``tensors``: what the stage sends (``lead``) or receives, with their
    ``requires_grad``; ``{"send": [...], "recv": [...]}``.

    Collective over ``group``: a rank at neither end (``lead`` None) only joins the barrier that
    starts every timed part together."""
    like = [x for x in tensors if x.requires_grad]  # the activations a gradient comes back for
    back = [torch.ones_like(x) for x in like] if lead is False else []
    cuda = any(t.is_cuda for t in tensors)
    samples: dict[str, list[float]] = {"send": [], "recv": []}
    for j in range(warmup + repeat):
        for kind in (ACT, GRAD):  # every rank takes both turns: only the two ends know whether a gradient travels
            sending = (kind == ACT) == bool(lead)
            active = lead is not None and (kind == ACT or bool(like))
            timed = []
            for with_message in (True, False):
                dist.barrier(group=group)
                if not active:
                    continue
                t0 = time.perf_counter()
                if with_message and sending:
                    comm.reap()
                    if kind == ACT:
                        comm.send(ACT, boundary, j, list(tensors))
                    else:
                        comm.send(GRAD, boundary, j, list(back), like=like)
                elif with_message:
                    comm.prepost(kind, boundary, j)
                work()
                if with_message and not sending:
                    comm.recv(kind, boundary, j)
                if cuda:
                    torch.cuda.synchronize()
                timed.append(time.perf_counter() - t0)
            if active and j >= warmup:
                samples["send" if sending else "recv"].append((timed[0] - timed[1]) * 1e3)
    return samples


def _measure(rank: int, world: int, send, device_type: str) -> tuple[list[float], list[float]]:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    small = [torch.zeros(1, dtype=torch.float32, device=device)]
    large = [torch.zeros(_LARGE // 4, dtype=torch.float32, device=device)]
    return pingpong(small, 1 - rank, rank == 0, repeat=30), pingpong(large, 1 - rank, rank == 0)


def estimate_link(device: torch.device) -> LinkModel:
    """Latency and bandwidth between two local processes: NCCL between two GPUs when there are
    two, else gloo through the host (then an upper bound on what a GPU interconnect takes, and
    on a GPU a caveat naming the option that gives the link)."""
    nccl = device.type == "cuda" and torch.cuda.device_count() >= 2
    (smalls, larges), _ = run_local(_measure, 2, "cuda" if nccl else "cpu", backend="nccl" if nccl else "gloo",
                                   timeout=LINK_ESTIMATE_TIMEOUT_S)
    small, large = min(smalls), min(larges)
    bandwidth = _LARGE / max(large - small, MIN_TIME_MS) / 1e6
    how = "2 local processes, NCCL between 2 GPUs" if nccl else "2 local processes, gloo over loopback TCP"
    caveat = None
    if device.type == "cuda" and not nccl:
        caveat = (f"the links were estimated through the host (gloo over loopback TCP, {small:.3g} ms + bytes at "
                  f"{bandwidth:.3g} GB/s), not between GPUs: one GPU is visible. Give the cluster's link with "
                  "--link-bandwidth GB/s (and --link-latency ms)")
    return LinkModel(small, bandwidth, how, {"4 B": Stats.of(smalls).record(), "16 MiB": Stats.of(larges).record()},
                     caveat=caveat)
