"""Activation checkpointing inside a split stage: ``torch.utils.checkpoint`` (reentrant or not)
and Hugging Face's ``gradient_checkpointing_enable()``. Every pass order a schedule may run
(several microbatches in flight, some fused) gives the gradients of one plain ``loss.backward()``
per microbatch bit for bit, with parameter hooks firing as there, and the activations of the
unsplit forward (``tests.helpers.split_oracle``)."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tests.helpers import split_oracle as oracle


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(self.ln(x))
        F.gelu(h).mul_(0.5)  # an in-place op inside the region
        return x + self.out(torch.tanh(h))


class Checkpointed(nn.Module):
    """Two checkpointed blocks between plain layers; a first stage embeds token ids. ``shared``:
    the head's weight is also used inside the second region."""

    def __init__(self, reentrant: bool, first: bool, shared: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8) if first else None
        self.pre = nn.Linear(8, 8)
        self.b1, self.b2 = Block(), Block()
        self.head = nn.Linear(8, 8)
        self.reentrant, self.shared = reentrant, shared

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        x = torch.relu(self.pre(x))
        x = checkpoint(self.b1, x, use_reentrant=self.reentrant)
        if self.shared:
            x = checkpoint(lambda y: self.b2(F.linear(y, self.head.weight)), x, use_reentrant=self.reentrant)
        else:
            x = checkpoint(self.b2, x, use_reentrant=self.reentrant)
        return self.head(x)


def _check(ref: nn.Module, ours: nn.Module, inputs, grads, post=None, deferred=False, seeds=(0, 1), what=""):
    """Each of ``seeds`` a pass order; hooks on every parameter of both."""
    for seed in seeds:
        for mod in (ref, ours):
            mod.zero_grad(set_to_none=True)
        ref_hooks, our_hooks = oracle.Hooked(ref), oracle.Hooked(ours)
        want = oracle.reference(ref, inputs, grads, post=post, hooks=ref_hooks)
        order = oracle.pipeline_order(random.Random(seed), len(inputs), fuse=0.25)
        got = oracle.split(ours, inputs, grads, order, post=post, hooks=our_hooks, deferred_first=deferred)
        for h in ref_hooks.handles + our_hooks.handles:
            h.remove()
        oracle.assert_same(got, want, f"{what} order {order}")


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("where", ["middle", "first", "first-deferred", "shared"])
def test_torch_checkpoint_inside_a_split_stage_is_exact(reentrant, where):
    first = where.startswith("first")
    torch.manual_seed(0)
    ref = Checkpointed(reentrant, first, shared=where == "shared")
    ours = copy.deepcopy(ref)
    m = 4
    if first:
        inputs = [[torch.randint(0, 11, (2, 3))] for _ in range(m)]
    else:
        inputs = [[torch.randn(2, 3, 8, requires_grad=True)] for _ in range(m)]
    grads = [[torch.randn(2, 3, 8)] for _ in range(m)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reentrant variant warns about inputs without gradient
        _check(ref, ours, inputs, grads, deferred=where == "first-deferred", what=where)


def _hf_cases():
    for preset in ("llama-tiny", "qwen2-tiny"):
        yield preset, False
    yield "llama-tiny", True


@pytest.mark.parametrize(("preset", "reentrant"), list(_hf_cases()))
def test_hugging_face_gradient_checkpointing_on_split_stages_is_exact(preset, reentrant):
    """``model.gradient_checkpointing_enable()`` (non-reentrant by default) on a tiny random
    decoder cut into three stages: every stage, the first with W plain and deferred."""
    pytest.importorskip("transformers")
    from zbsearch.models.hf import hf_batch, hf_config, hf_loss, hf_model, hf_stages

    cfg = hf_config(preset, num_hidden_layers=3)
    model = hf_model(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    stages = hf_stages(model, 3).stages
    m = 3
    batches = [hf_batch(cfg, 2, 8, seed=10 + j) for j in range(m)]
    inputs: list[list[list[torch.Tensor]]] = [[], [], []]
    for x, _ in batches:
        with torch.no_grad():
            for s in range(3):
                inputs[s].append([t.detach().requires_grad_(t.is_floating_point()) for t in x])
                x = stages[s](*x)
                x = x if isinstance(x, tuple) else (x,)
    posts = [(lambda o, labels=labels: hf_loss(o, labels)) for _, labels in batches]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s, deferred in [(0, False), (0, True), (1, False), (2, False)]:
            ref, ours = copy.deepcopy(stages[s]), copy.deepcopy(stages[s])
            if s == 2:
                grads = [[torch.ones(())] for _ in range(m)]
            else:
                with torch.no_grad():
                    outs = [stages[s](*x) for x in inputs[s]]
                # a gradient for the hidden states; the other outputs (mask, positions) take none
                grads = [[torch.randn_like(o[0]), *[None] * (len(o) - 1)] for o in outs]
            _check(ref, ours, inputs[s], grads, post=posts if s == 2 else None, deferred=deferred, seeds=(s,),
                   what=f"{preset} stage {s}{' deferred' if deferred else ''}")
