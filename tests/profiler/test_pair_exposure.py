"""The share of what an overlapped pair hides that still costs time (``pair_exposed``), as the
profiler measures it (``zbsearch.profiler.pairs``), on stages whose answer is known by design.

Each stage sleeps: its compute holds the process's one device (a lock, as two passes of one
process share an accelerator) and its all-to-all is a sleep reported to the all-to-all clock,
part of it holding the device too (``held``, a share: communication that takes the resources
the other pass computes with). F runs its all-to-all first then computes, B computes then runs
its all-to-all, so in a pair everything the cost rule hides is hidden where ``held`` is 0, and
the held share is not: the pair costs the rule's time plus ``held`` of what it hides, and the
measured share is ``held`` (0, 0.5, 1 here; a thread's wake-up on a loaded machine adds a little).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from zbsearch.costs import hidden_all_to_all
from zbsearch.profiler.pairs import pair_rounds

COMPUTE_MS, COMM_MS = 40.0, 20.0  # long enough that a thread's wake-up on a loaded machine is small beside them
_DEVICE = threading.Lock()


def _comm(backward: bool, held: float) -> None:
    from zbsearch.models import moe

    start = time.perf_counter()
    time.sleep(COMM_MS * (1 - held) / 1e3)
    with _DEVICE:
        time.sleep(COMM_MS * held / 1e3)
    for clock in moe._CLOCKS:  # what the real exchange reports (``all_to_all_time``)
        clock.add(backward, time.perf_counter() - start)


class _Pass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, held: float):
        ctx.held = held
        _comm(False, held)
        with _DEVICE:
            time.sleep(COMPUTE_MS / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        with _DEVICE:
            time.sleep(COMPUTE_MS / 1e3)
        _comm(True, ctx.held)
        return g.clone(), None


class _Stage(nn.Module):
    def __init__(self, held: float) -> None:
        super().__init__()
        self.held = held
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _Pass.apply(x * self.w, self.held)


def test_the_measured_share_is_what_the_pair_really_leaves_exposed():
    helds = [0.0, 0.5, 1.0]
    stages = [_Stage(h) for h in helds]
    x = (torch.ones(2, 4, requires_grad=True),)
    got = pair_rounds(stages, [x] * 3, [None] * 3, None, repeat=5, warmup=1)
    for held, rounds in zip(helds, got):
        assert len(rounds.pair) == len(rounds.t_f) == len(rounds.a_b) == 5 and len(rounds.samples) == 5
        # the passes and their all-to-all as built (sleeps only oversleep)
        assert min(rounds.a_f) >= COMM_MS * 0.95 and min(rounds.t_f) >= (COMPUTE_MS + COMM_MS) * 0.95
        # the share, and the pair against the rule's time and the sum, round by round's median
        assert rounds.exposed == pytest.approx(held, abs=0.25), (held, rounds.samples)
        assert 0.0 <= rounds.exposed <= 1.0
        t_f, t_b = sorted(rounds.t_f)[2], sorted(rounds.t_b)[2]
        hidden = sum(hidden_all_to_all(t_f, t_b, sorted(rounds.a_f)[2], sorted(rounds.a_b)[2]))
        assert sorted(rounds.pair)[2] == pytest.approx(t_f + t_b - (1 - held) * hidden, abs=0.25 * hidden)
    assert got[0].exposed < got[1].exposed < got[2].exposed  # more held, more exposed
    assert all(s.w.grad is None for s in stages)  # no gradient left behind, as the profiler leaves a model
