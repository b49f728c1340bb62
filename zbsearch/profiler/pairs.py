"""What an overlapped pair really costs on an expert group: each stage's ``pair_exposed``.

The runtime runs an overlapped pair's forward on a worker thread while its backward runs on its
own, each pass's all-to-all on its own expert-parallel group (``zbsearch.runtime.runtime``), so
that one's communication is in flight while the other computes. The cost rule
(``zbsearch.costs``) takes off the pair what each pass's all-to-all hides behind the other's
compute. Hidden is not always free: on a CPU gloo serves the collective with threads that take
the cores the other pass computes on, and a peer blocked in a collective wakes late; on a GPU
the communication kernels take streaming multiprocessors. This module measures the share of the
hidden time that still costs the rank, on the expert group, every member at once:

* after ``warmup`` rounds, ``repeat`` rounds of, on each stage: one microbatch's F alone then
  its B alone, each timed with the all-to-all inside it (``all_to_all_time``), then its W; and a
  pair: the F of one microbatch on a thread while the B of another (whose F ran before, untimed)
  runs, timed as one block from both started to both done (the alone passes first in even
  rounds, the pair first in odd ones, so that what a place in the round does cancels). The
  members meet at a barrier before each timed part: a sample is the passes, not a peer's lag.

A round's sample is ``1 - (t_F + t_B - pair) / (h_F + h_B)``, with ``h`` what the rule says the
pair hides (``hidden_all_to_all``) of the round's own alone times: 0 where the pair took what the
rule says, 1 where it took as long as the two passes back to back. Rounds with nothing to hide
are left out. A stage's share is the samples' median, clipped to [0, 1].
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..costs import hidden_all_to_all

__all__ = ["PairRounds", "pair_rounds", "PAIR_THREAD"]

PAIR_THREAD = "zbsearch-profile-pair"  # the thread that runs a timed pair's forward

# Below this many ms hidden a round tells nothing about the share (the ratio is noise).
_LEAST_HIDDEN_MS = 1e-3


@dataclass
class PairRounds:
    """One stage's timed rounds (ms each): its passes alone, the all-to-all inside them, and
    the pair of a forward and another microbatch's backward run at once."""

    t_f: list[float] = field(default_factory=list)
    t_b: list[float] = field(default_factory=list)
    t_w: list[float] = field(default_factory=list)
    a_f: list[float] = field(default_factory=list)
    a_b: list[float] = field(default_factory=list)
    pair: list[float] = field(default_factory=list)

    @property
    def samples(self) -> list[float]:
        """Per round with something to hide, the share of it the pair did not save (module)."""
        out = []
        for t_f, t_b, a_f, a_b, pair in zip(self.t_f, self.t_b, self.a_f, self.a_b, self.pair):
            hidden = sum(hidden_all_to_all(t_f, t_b, min(a_f, t_f), min(a_b, t_b)))
            if hidden > _LEAST_HIDDEN_MS:
                out.append(1.0 - (t_f + t_b - pair) / hidden)
        return out

    @property
    def exposed(self) -> float | None:
        """The stage's ``pair_exposed``: the samples' median in [0, 1]; None without a sample."""
        got = self.samples
        return min(1.0, max(0.0, statistics.median(got))) if got else None


def pair_rounds(stages: Sequence[nn.Module], inputs: Sequence[tuple], posts: Sequence[Callable | None],
                group: dist.ProcessGroup | None, repeat: int, warmup: int,
                device: torch.device | None = None) -> list[PairRounds]:
    """Collective over ``group`` (the expert group; None: the default group, or none in a
    process without one): per stage, its
    rounds (module docstring) on ``inputs`` (the stage's leaves), ``posts`` run on its
    outputs (the loss on a last stage, or None), each backward seeded with ones."""
    from ..models.moe import all_to_all_time
    from ..runtime.split import backward_input, backward_weight, forward_pass

    cuda = device is not None and device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def barrier() -> None:
        sync()
        if group is not None or dist.is_initialized():
            dist.barrier(group=group)

    out = []
    worker = ThreadPoolExecutor(1, thread_name_prefix=PAIR_THREAD)  # one thread kept, as the runtime keeps its
    with worker, torch.enable_grad():
        for stage, x, post in zip(stages, inputs, posts):
            def forward(stage: nn.Module = stage, x: tuple = x, post: Callable | None = post):
                return forward_pass(stage, x, post=post)

            def backward(fp):
                return backward_input(fp, [torch.ones_like(o) if o.requires_grad else None for o in fp.outputs])

            got = PairRounds()
            for k in range(warmup + repeat):
                keep = k >= warmup
                for part in (("alone", "pair") if k % 2 == 0 else ("pair", "alone")):
                    if part == "alone":
                        barrier()
                        with all_to_all_time() as clock:
                            t0 = time.perf_counter()
                            fp = forward()
                            sync()
                            t1 = time.perf_counter()
                        a_f = clock.forward
                        barrier()
                        with all_to_all_time() as clock:
                            t2 = time.perf_counter()
                            _, w = backward(fp)
                            sync()
                            t3 = time.perf_counter()
                        backward_weight(w)
                        sync()
                        t4 = time.perf_counter()
                        if keep:
                            got.t_f.append((t1 - t0) * 1e3)
                            got.t_b.append((t3 - t2) * 1e3)
                            got.t_w.append((t4 - t3) * 1e3)
                            got.a_f.append(a_f * 1e3)
                            got.a_b.append(clock.backward * 1e3)
                    else:
                        earlier = forward()  # the pair's backward is of this microbatch
                        barrier()
                        took, later, w = _pair(worker, forward, functools.partial(backward, earlier), sync,
                                               device if cuda else None)
                        backward_weight(w)
                        backward_weight(backward(later)[1])
                        if keep:
                            got.pair.append(took)
            stage.zero_grad(set_to_none=True)
            out.append(got)
    return out


def _pair(worker: ThreadPoolExecutor, forward: Callable, backward: Callable, sync: Callable[[], None],
          device: torch.device | None):
    """(ms, the forward's pass, the backward's W) of ``forward`` on ``worker``'s thread while
    ``backward`` runs on this one, from both started to both done, as the runtime runs a pair."""
    def run():
        if device is not None:
            torch.cuda.set_device(device)
        with torch.enable_grad():
            return forward()

    t0 = time.perf_counter()
    running = worker.submit(run)
    try:
        _, w = backward()
    finally:
        fp = running.result()  # (the forward's error, if it raised, wins: it came first, as in the runtime)
    sync()
    return (time.perf_counter() - t0) * 1e3, fp, w
