"""``zbsearch.runtime.engine``: autograd's engine called directly gives what ``torch.autograd``'s
``backward`` / ``grad`` give, bit for bit (the gradients, ``.grad`` accumulation, retained or
freed graphs), and every call the direct path does not take (a gradient of another shape, a
tensor subclass, a torch-function mode) goes to ``torch.autograd`` with its own error or result.

Cases are generated: small random graphs (matrix products, elementwise ops, reductions, several
outputs sharing parameters, leaves with and without ``.grad``), asked for by backward, by
``inputs=`` or by grad, on float32 and float64.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from zbsearch.runtime import engine


def _graph(seed: int):
    """Leaves (one input that may need no gradient, parameters) and a function of them giving
    1-3 outputs of random shapes."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.float64])
    g = torch.Generator().manual_seed(seed)
    n, d = rng.randint(1, 5), rng.randint(1, 6)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    params = [torch.randn(d, d, generator=g, dtype=dtype) for _ in range(rng.randint(1, 3))]
    ops = [rng.choice(["mm", "tanh", "mul", "add", "sum0", "sq"]) for _ in range(rng.randint(1, 6))]
    taps = sorted(rng.sample(range(len(ops)), min(len(ops), rng.randint(1, 3))))
    summed = {k: rng.random() < 0.3 for k in taps}

    def run(x, params):
        h, outs = x @ params[-1], []  # every output needs a gradient (as the runtime's roots do)
        for k, op in enumerate(ops):
            p = params[k % len(params)]
            if op == "mm":
                h = h @ p
            elif op == "tanh":
                h = torch.tanh(h)
            elif op == "mul":
                h = h * p[0]
            elif op == "add":
                h = h + p.sum(0)
            elif op == "sum0":
                h = h.sum(0, keepdim=True).expand_as(x) * 0.5
            else:
                h = h * h
            if k in taps:
                outs.append(h.sum(1) if summed[k] else h)
        return outs

    return rng, x, params, run


def _leaves(x, params, x_grad: bool, with_grad: bool, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    leaves = [x.clone().requires_grad_(x_grad)] + [p.clone().requires_grad_() for p in params]
    if with_grad:  # gradients already there: the call adds to them
        for t in leaves:
            if t.requires_grad:
                t.grad = torch.randn(t.shape, generator=g, dtype=t.dtype)
    return leaves


def _same(a, b) -> bool:
    if isinstance(a, bool):
        return a == b
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("seed", range(60))
def test_backward_and_grad_equal_torch_autograd(seed):
    rng, x, params, run = _graph(seed)
    x_grad, with_grad = rng.random() < 0.6, rng.random() < 0.5
    how = rng.choice(["backward", "backward_inputs", "grad", "grad_retained"])
    results = []
    for call in ("engine", "torch"):
        leaves = _leaves(x, params, x_grad, with_grad, seed)
        outs = run(leaves[0], leaves[1:])
        gen = torch.Generator().manual_seed(seed + 2)
        grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        wanted = [t for t in leaves if t.requires_grad]
        asked = wanted[: max(1, len(wanted) - 1)] if how != "backward" else []
        if how.startswith("backward"):
            if call == "engine":
                engine.backward(outs, grads, asked)
            else:
                torch.autograd.backward(outs, grads, inputs=asked or None)
            got = [t.grad.clone() if t.grad is not None else None for t in leaves]
            try:  # the graph was freed (where a node saved something): raises alike
                torch.autograd.backward(outs, grads)
                freed = False
            except RuntimeError:
                freed = True
            got += [freed] + [t.grad for t in leaves]
        else:
            retain = how == "grad_retained"
            if call == "engine":
                got = list(engine.grad(outs, wanted, grads, retain_graph=retain))
            else:
                got = list(torch.autograd.grad(outs, wanted, grads, retain_graph=retain, allow_unused=True))
            got += [t.grad for t in leaves]  # untouched
            if retain:  # the graph is still there: a second call gives the same again
                if call == "engine":
                    again = engine.grad(outs, wanted, grads)
                else:
                    again = torch.autograd.grad(outs, wanted, grads, allow_unused=True)
                assert all(_same(a, b) for a, b in zip(again, got))
        results.append(got)
    assert len(results[0]) == len(results[1])
    assert all(_same(a, b) for a, b in zip(*results))


def test_a_gradient_of_another_shape_gets_torch_autograds_error():
    w = torch.randn(3, requires_grad=True)
    for call in (lambda o, g: engine.backward([o], [g]), lambda o, g: engine.grad([o], [w], [g])):
        with pytest.raises(RuntimeError, match="Mismatch in shape"):
            call(w * 2, torch.ones(4))


def test_a_complex_gradient_of_a_real_output_gets_torch_autograds_error():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="complex"):
        engine.backward([w * 2], [torch.ones(3, dtype=torch.complex64)])


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def test_an_active_torch_function_mode_sees_the_call_as_with_torch_autograd():
    seen = []
    for call in ("engine", "torch"):
        w = torch.ones(3, requires_grad=True)
        out = w * 2
        with _Counting() as mode:
            if call == "engine":
                engine.backward([out], [torch.ones(3)])
            else:
                torch.autograd.backward([out], [torch.ones(3)])
        seen.append((mode.calls, w.grad))
    assert seen[0][0] == seen[1][0] and "backward" in seen[0][0]
    assert torch.equal(seen[0][1], seen[1][1])


class _Sub(torch.Tensor):
    pass


def test_a_tensor_subclass_goes_through_torch_autograd(monkeypatch):
    direct = []
    real = engine._ENGINE
    monkeypatch.setattr(engine, "_ENGINE", lambda *a, **k: direct.append(1) or real(*a, **k))
    w = torch.ones(3, requires_grad=True)
    engine.backward([(w * 2).as_subclass(_Sub)], [torch.ones(3)])
    assert torch.equal(w.grad, torch.full((3,), 2.0))
    assert not direct
    engine.backward([w * 3], [torch.ones(3)])
    assert direct == [1] and torch.equal(w.grad, torch.full((3,), 5.0))


def test_without_the_engine_function_the_public_call_runs(monkeypatch):
    monkeypatch.setattr(engine, "_ENGINE", None)
    w = torch.ones(3, requires_grad=True)
    engine.backward([w * 2], [torch.ones(3)])
    (g,) = engine.grad([w * 3], [w], [torch.ones(3)])
    assert torch.equal(w.grad, torch.full((3,), 2.0)) and torch.equal(g, torch.full((3,), 3.0))
