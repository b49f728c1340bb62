"""Generated stage code through the split backward (``tests.helpers.programs``): each stage
gives the gradients of one plain ``loss.backward()`` per microbatch bit for bit, in a random
pipeline order of F, B, W and fused BW passes over several microbatches, with parameter hooks
firing as there and the activations of the unsplit forward; or it is refused as
``loss.backward()`` refuses it; or, for what cannot be split exactly (a forward that changes a
parameter in place), refused in one line naming the parameter before any backward runs."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import split_oracle as oracle
from tests.helpers.programs import B, D, Program, T, V
from zbsearch.runtime import PipelineError

SEEDS = 40  # each a few hundred ms


def _case(seed: int):
    rng = random.Random(seed)
    where = rng.choice(["first", "middle", "middle", "last"])
    mutate = rng.random() < 0.05
    torch.manual_seed(seed)
    module = Program(rng, where, mutate=mutate)
    m = rng.randint(3, 5)
    g = torch.Generator().manual_seed(seed)
    inputs, grads, posts = [], [], []
    for _ in range(m):
        ids = torch.randint(0, V, (B, T), generator=g)
        ids[0, -1] = 0  # a padding token
        if where == "first":
            inputs.append([ids])
        else:
            inputs.append([torch.randn(B, T, D, generator=g).requires_grad_(), ids])
        if where == "last":
            target = torch.randint(0, V, (B, T), generator=g)
            if module.head is not None or module.tie_head:
                posts.append(lambda o, t=target: F.cross_entropy(o.reshape(-1, V), t.reshape(-1)))
            else:
                posts.append(lambda o, t=target: F.mse_loss(o, F.one_hot(t % D, D).float()))
            grads.append([torch.ones(())])
        else:
            grads.append([torch.randn(B, T, D, generator=g), None])
    order = oracle.pipeline_order(rng, m, fuse=0.0 if mutate else 0.2)  # a split pass refuses mutation
    deferred = where == "first" and rng.random() < 0.5
    hooks = rng.random() < 0.4
    return module, inputs, grads, posts if where == "last" else None, order, deferred, hooks, mutate


def _run(fn):
    try:
        return fn(), None
    except Exception as err:  # compared below: the split must refuse what loss.backward() refuses
        return None, err


@pytest.mark.parametrize("seed", range(SEEDS))
def test_generated_stage_is_exact_or_refused(seed):
    module, inputs, grads, posts, order, deferred, hooks, mutate = _case(seed)
    ref, ours = module, copy.deepcopy(module)
    what = f"seed {seed}, order {order}{', first stage W deferred' if deferred else ''}\n{module.describe()}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1000 + seed)  # dropout: the same draws, forward after forward
        want, ref_err = _run(lambda: oracle.reference(ref, inputs, grads, post=posts,
                                                      hooks=oracle.Hooked(ref) if hooks else None))
        torch.manual_seed(1000 + seed)
        got, err = _run(lambda: oracle.split(ours, inputs, grads, order, post=posts,
                                             hooks=oracle.Hooked(ours) if hooks else None, deferred_first=deferred))
    if mutate:
        assert isinstance(err, PipelineError), f"{what}\nnot refused: {err!r}"
        assert "\n" not in str(err) and "linears." in str(err), str(err)
        return
    if ref_err is not None:
        assert err is not None, f"{what}\nloss.backward() refuses ({ref_err}) but the split ran"
        return
    if err is not None:
        raise AssertionError(f"{what}\nthe split failed: {type(err).__name__}: {err}") from err
    assert got is not None and want is not None
    oracle.assert_same(got, want, what)
