"""Unsplit passes counted from footprints (``zbsearch.runtime.footprint``): the meter reads, at
every pass boundary, exactly what the saved-tensor hooks would have counted
(``ActivationMeter(replay=False)`` meters every pass with them), and gradients stay those of
one plain ``loss.backward()`` per microbatch, bit for bit.

Cases are generated: GPT, Llama-style and toy stages (first, middle, last) of several shapes;
fused passes (BW), a first stage's whole backward (F, B, W) and split passes mixed on one
module; several microbatches in flight in random F/B/W orders; inputs that are views of one
batch or tensors of their own; a loss given its targets by ``functools.partial`` or a lambda.
"""

from __future__ import annotations

import copy
import functools
import random
import weakref

import pytest
import torch
from torch import nn

from tests.helpers.toy import VOCAB, toy_loss, toy_stages
from zbsearch.models import GPTConfig, gpt_loss, gpt_stages, llama_stages
from zbsearch.runtime import backward_full, backward_input, backward_weight, forward_pass
from zbsearch.runtime.memory import ActivationMeter, SavedActivations


@pytest.fixture
def hooked(monkeypatch) -> weakref.WeakSet:
    """The SavedActivations whose forward ran under the hooks."""
    seen: weakref.WeakSet = weakref.WeakSet()
    original = SavedActivations.hooks

    def hooks(self, *args, **kw):
        seen.add(self)
        return original(self, *args, **kw)

    monkeypatch.setattr(SavedActivations, "hooks", hooks)
    return seen


def _case(seed: int):
    """A stage, its microbatches (inputs, loss, output gradients) and a random pass order."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    family = rng.choice(["gpt", "llama", "toy"])
    where = rng.randrange(3)
    m = rng.randint(3, 7)
    mb = rng.choice([1, 2])
    if family == "toy":
        stages, seqs, vocab, loss = toy_stages(3, seed=seed), [5], VOCAB, toy_loss
    else:
        seq = rng.choice([3, 5, 8])
        cfg = GPTConfig(layers=3, hidden=rng.choice([8, 16, 32]), heads=2, seq=seq, vocab=17, microbatch_size=mb, stages=3)
        stages, vocab, loss = (gpt_stages if family == "gpt" else llama_stages)(cfg, seed=seed), cfg.vocab, gpt_loss
        seqs = [seq, max(1, seq - 2)] if rng.random() < 0.2 else [seq]  # sometimes a signature that changes
    one_batch = rng.random() < 0.5  # microbatches as views of one batch, as the runtime splits it
    lengths = [rng.choice(seqs) for _ in range(m)]
    if one_batch:
        lengths = [lengths[0]] * m
        ids = torch.randint(0, vocab, (m * mb, lengths[0])).chunk(m)
        targets = torch.randint(0, vocab, (m * mb, lengths[0])).chunk(m)
    else:
        ids = [torch.randint(0, vocab, (mb, n)) for n in lengths]
        targets = [torch.randint(0, vocab, (mb, n)) for n in lengths]
    inputs = []
    for j in range(m):
        x = (ids[j],)
        with torch.no_grad():
            for st in stages[:where]:
                x = st(*x)
                x = x if isinstance(x, tuple) else (x,)
        inputs.append(tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x))
    last = where == 2
    partial = rng.random() < 0.5
    posts = [
        (functools.partial(loss, targets=targets[j]) if partial else (lambda o, t=targets[j]: loss(o, t))) if last else None
        for j in range(m)
    ]
    # each microbatch fused (BW) or not (a first stage's F, B, W; the split backward elsewhere)
    modes = [rng.choice(["fused", "split"]) for _ in range(m)] if rng.random() < 0.5 else [rng.choice(["fused", "split"])] * m
    cap = rng.randint(1, 4)  # microbatches in flight at most
    order, started, steps = [], 0, {j: ["F", "BW"] if modes[j] == "fused" else ["F", "B", "W"] for j in range(m)}
    while any(steps.values()):
        live = [j for j in range(started) if steps[j] and steps[j][0] != "F"]
        choices = live + ([started] if started < m and len(live) < cap else [])
        j = rng.choice(choices)
        started += j == started
        order.append((j, steps[j].pop(0)))
    return stages[where], inputs, posts, modes, order, len(set(lengths)) == 1


def _run(module, inputs, posts, modes, order, meter, grads_out, input_grads, hooked=None, unsplit=None):
    """Replays ``order`` on ``module``; yields (meter bytes, peak) after every pass.
    ``unsplit``: the unsplit forwards are listed there, True where the hooks ran."""
    passes = {}
    for j, op in order:
        if op == "F":
            passes[j] = forward_pass(module, inputs[j], split=modes[j] == "split", post=posts[j], meter=meter)
            if unsplit is not None and (modes[j] == "fused" or passes[j].whole_in_w):
                unsplit.append(passes[j].saved in hooked)
            if j not in grads_out:
                grads_out[j] = [torch.randn_like(o) if o.requires_grad else None for o in passes[j].outputs]
        elif op == "B":
            input_grads[j], passes[j] = backward_input(passes[j], grads_out[j])
        elif op == "W":
            backward_weight(passes.pop(j))
        else:
            input_grads[j] = backward_full(passes.pop(j), grads_out[j])
        yield meter.bytes, meter.peak


def _plain(module, inputs, posts, order, grads_out):
    """One plain forward and loss.backward() per microbatch, in the order their gradients
    complete; the input gradients."""
    got = {}
    for j, op in order:
        if op in ("W", "BW"):
            xs = [x.detach().requires_grad_(x.requires_grad) for x in inputs[j]]
            out = module(*xs)
            outs = (posts[j](out),) if posts[j] is not None else (out if isinstance(out, tuple) else (out,))
            pairs = [(o, g) for o, g in zip(outs, grads_out[j]) if g is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            got[j] = [x.grad for x in xs]
    return got


def _bitwise(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("seed", range(48))
def test_footprints_count_what_the_hooks_count(seed, hooked):
    module, inputs, posts, modes, order, uniform = _case(seed)
    ours, ref, plain = module, copy.deepcopy(module), copy.deepcopy(module)
    grads_out: dict = {}
    mine, theirs = ActivationMeter(), ActivationMeter(replay=False)
    unsplit: list[bool] = []
    our_grads: dict = {}
    ours_run = _run(ours, inputs, posts, modes, order, mine, grads_out, our_grads, hooked, unsplit)
    ref_run = _run(ref, inputs, posts, modes, order, theirs, grads_out, {})
    for (j, op), got, want in zip(order, ours_run, ref_run):
        assert got == want, f"(bytes, peak) after {op}{j}"
    assert mine.bytes == 0
    expected = _plain(plain, inputs, posts, order, grads_out)
    for j, gs in expected.items():
        assert all(_bitwise(g, x) for g, x in zip(gs, our_grads[j])), f"input gradient of microbatch {j}"
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert _bitwise(p.grad, q.grad), name
    if uniform:  # after two hooked forwards of the signature the others ran without the hooks
        assert unsplit[:2] == [True] * min(2, len(unsplit)) and not any(unsplit[2:])


class _Routed(nn.Module):
    """Saves tensors whose sizes follow the data (as token routing does)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.exp(x[x > 0]).sum() * self.w


class _Cached(nn.Module):
    """Keeps a table it builds on first use (not a buffer) and saves it in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.table: torch.Tensor | None = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.randn(3, 6)
        return self.lin(x * self.table)


def _lockstep(ours, ref, inputs, order, hooked, rebuild_at=()):
    """Fused passes in ``order`` on both modules, ours counted as it does and ref by the hooks;
    at each position in ``rebuild_at`` both drop their cached table. Checks the meters after
    every pass; returns, per forward, whether ours ran under the hooks."""
    mine, theirs = ActivationMeter(), ActivationMeter(replay=False)
    passes: dict = {}
    ran_hooked = []
    for k, (j, op) in enumerate(order):
        if k in rebuild_at:
            ours.table = ref.table = None
        for mod, meter in ((ours, mine), (ref, theirs)):
            if op == "F":
                fp = passes[(j, meter)] = forward_pass(mod, [inputs[j]], split=False, meter=meter)
                if mod is ours:
                    ran_hooked.append(fp.saved in hooked)
            else:
                fp = passes.pop((j, meter))
                backward_full(fp, [torch.ones_like(fp.outputs[0])])
        assert (mine.bytes, mine.peak) == (theirs.bytes, theirs.peak), f"after {op}{j}"
    assert mine.bytes == 0
    return ran_hooked


def _in_flight(m: int, cap: int) -> list[tuple[int, str]]:
    """F and BW of m microbatches, ``cap`` in flight (as 1F1B's warm-up)."""
    order = [(j, "F") for j in range(min(cap, m))]
    for j in range(m):
        order.append((j, "BW"))
        if j + cap < m:
            order.append((j + cap, "F"))
    return order


def test_a_forward_whose_saved_sizes_follow_the_data_is_metered_by_the_hooks(hooked):
    torch.manual_seed(0)
    ours = _Routed()
    ref = copy.deepcopy(ours)
    inputs = []
    for j in range(12):  # j + 1 positive entries: each forward saves other sizes
        x = -torch.rand(16)
        x[: j + 1] = torch.rand(j + 1) + 0.1
        inputs.append(x.requires_grad_())
    ran_hooked = _lockstep(ours, ref, inputs, _in_flight(12, 3), hooked)
    assert all(ran_hooked)


def test_a_kept_table_is_shared_and_a_rebuilt_one_learnt_again(hooked):
    torch.manual_seed(0)
    ours = _Cached()
    ref = copy.deepcopy(ours)
    inputs = [torch.randn(2, 3, 6, requires_grad=True) for _ in range(16)]
    order = _in_flight(8, 3) + [(j + 8, op) for j, op in _in_flight(8, 2)]
    ran_hooked = _lockstep(ours, ref, inputs, order, hooked, rebuild_at={len(_in_flight(8, 3))})
    # learnt on the first two forwards; after the rebuild (the table died) on the next two
    assert ran_hooked == [True, True] + [False] * 6 + [True, True] + [False] * 6


def test_without_a_meter_an_unsplit_pass_runs_without_hooks(hooked):
    mod = _Cached()
    for split in (False, True):
        fp = forward_pass(mod, [torch.randn(3, 6)], split=split)  # split: a first stage, whole backward
        assert fp.saved not in hooked
        _, w = backward_input(fp, [torch.ones(3, 6)])
        backward_weight(w)
        assert mod.lin.weight.grad is not None
