"""Gradients that do not exist stay None across stages, as in one process.

A stage whose output ignores (part of) its input gives autograd None for that input; earlier
stages must then leave the parameters only that input depended on with ``.grad`` None (not
zeros: AdamW would still decay them), over P2P and over a V rank's local hand-over alike.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zbsearch as zb
from tests.helpers.toy import uniform_profile
from zbsearch.distributed import run_local
from zbsearch.runtime import PipelineRuntime, backward_full, backward_input, backward_weight, forward_pass

_D = 4


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(_D, _D), nn.Linear(_D, _D)

    def forward(self, x):
        return torch.tanh(self.a(x)), torch.tanh(self.b(x))


class _Keep(nn.Module):
    """Uses both inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.d = nn.Linear(_D, _D), nn.Linear(_D, _D)

    def forward(self, x, y):
        return torch.tanh(self.c(x)), torch.tanh(self.d(y))


class _IgnoreY(_Keep):
    """Ignores its second input."""

    def forward(self, x, y):
        return torch.tanh(self.c(x)), torch.tanh(self.d(x))


class _IgnoreAll(_Keep):
    """A function of its own parameters only."""

    def forward(self, x, y):
        return self.c.bias.expand(x.shape[0], -1) * 1.0, self.d.bias.expand(x.shape[0], -1) * 2.0


class _Last(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.out = inner, nn.Linear(_D, _D)

    def forward(self, x, y):
        u, v = self.inner(x, y)
        return self.out(u + v)


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _stages(num_stages: int, variant: str) -> list[nn.Module]:
    torch.manual_seed(0)
    ignore = {"y": _IgnoreY, "all": _IgnoreAll}[variant]
    if num_stages == 2:  # the last stage ignores: P2P carries the None
        return [_Head(), _Last(ignore())]
    # V: stage 2 shares rank 1 with stage 1, so the None goes through the local hand-over first
    return [_Head(), _Keep(), ignore(), _Last(_Keep())]


def _check(rank: int, world: int, send, kind: str, variant: str) -> int:
    m = 4
    sched = zb.build_classic(kind, uniform_profile(world), m)
    full = _stages(sched.num_stages, variant)
    ref = [copy.deepcopy(s) for s in full]
    mine = {s: copy.deepcopy(full[s]) for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
    ref_opt = torch.optim.AdamW([p for st in ref for p in st.parameters()], lr=0.1, weight_decay=0.5)
    our_opt = torch.optim.AdamW([p for st in mine.values() for p in st.parameters()], lr=0.1, weight_decay=0.5)
    runtime = PipelineRuntime(sched, mine, _loss, timeout=60)
    nones = 0
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(2 * m, _D, generator=g), torch.randn(2 * m, _D, generator=g)
        ref_opt.zero_grad()
        our_opt.zero_grad()
        h = (x,)
        for st in ref:
            h = st(*h)
            h = h if isinstance(h, tuple) else (h,)
        _loss(h[0], target).backward()
        runtime.step(x if 0 in mine else None, target if sched.num_stages - 1 in mine else None)
        for s, st in mine.items():
            for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                where = f"{kind} {variant} stage {s} {name}"
                assert (q.grad is None) == (p.grad is None), f"{where}: grad {q.grad} where one process has {p.grad}"
                if p.grad is None:
                    nones += 1
                else:
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda e, where=where: f"{where}: {e}")
        ref_opt.step()
        our_opt.step()
        for s, st in mine.items():
            for q, p in zip(st.parameters(), ref[s].parameters()):
                torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)
    return nones


@pytest.mark.parametrize("variant", ["y", "all"])
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-v"])
def test_none_gradients_match_one_process(kind, variant):
    nones = run_local(_check, 2, kind, variant)
    assert sum(nones) > 0  # the case is real: one process leaves some parameter without a gradient


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("which", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("module", [_Keep, _IgnoreY])
def test_split_backward_leaves_unreached_gradients_none(module, which, split):
    """B then W (or BW) with some or all output gradients None: as torch.autograd.backward."""
    torch.manual_seed(0)
    ref = module()
    ours = copy.deepcopy(ref)
    x, y = torch.randn(3, _D), torch.randn(3, _D)
    grads = [torch.randn(3, _D) if keep else None for keep in which]
    ref_in = [x.clone().requires_grad_(), y.clone().requires_grad_()]
    pairs = [(o, g) for o, g in zip(ref(*ref_in), grads) if g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    fp = forward_pass(ours, [x.clone().requires_grad_(), y.clone().requires_grad_()], split=split)
    if split:
        got, w = backward_input(fp, grads)
        assert all(p.grad is None for p in ours.parameters())  # W's work is still to come
        backward_weight(w)
    else:
        got = backward_full(fp, grads)
    for g, r in zip(got, ref_in):
        assert (g is None) == (r.grad is None)
        if g is not None:
            torch.testing.assert_close(g, r.grad)
    for (name, q), p in zip(ours.named_parameters(), ref.parameters()):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad)
