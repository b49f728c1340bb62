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
from zbsearch.runtime import footprint
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


def _run(module, inputs, posts, modes, order, meter, grads_out, hooked=None, unsplit=None):
    """Replays ``order`` on ``module``; yields (meter bytes, peak, input gradients so far) after
    every pass. ``unsplit``: the unsplit forwards are listed there, True where the hooks ran."""
    passes, input_grads = {}, {}
    for j, op in order:
        if op == "F":
            passes[j] = forward_pass(module, inputs[j], split=modes[j] == "split", post=posts[j], meter=meter)
            if unsplit is not None and (modes[j] == "fused" or passes[j].whole_in_w):
                unsplit.append(passes[j].saved in hooked)
            if j not in grads_out:
                grads_out[j] = [torch.randn_like(o) if o.requires_grad else None for o in passes[j].outputs]
        elif op == "B":
            input_grads[j] = backward_input(passes[j], grads_out[j])
        elif op == "W":
            backward_weight(passes.pop(j))
        else:
            input_grads[j] = backward_full(passes.pop(j), grads_out[j])
        yield meter.bytes, meter.peak, input_grads


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
    ours_run = _run(ours, inputs, posts, modes, order, mine, grads_out, hooked, unsplit)
    ref_run = _run(ref, inputs, posts, modes, order, theirs, grads_out)
    for (j, op), (b, peak, our_grads), (rb, rpeak, ref_grads) in zip(order, ours_run, ref_run):
        assert (b, peak) == (rb, rpeak), f"after {op}{j}"
    assert mine.bytes == 0
    expected = _plain(plain, inputs, posts, order, grads_out)
    for j, gs in expected.items():
        assert all(_bitwise(g, x) for g, x in zip(gs, our_grads[j])), f"input gradient of microbatch {j}"
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert _bitwise(p.grad, q.grad), name
    if uniform:  # after two hooked forwards of the signature the others ran without the hooks
        assert unsplit[:2] == [True] * min(2, len(unsplit)) and not any(unsplit[2:])
