"""The split backward against its oracle: one plain ``loss.backward()`` per microbatch.

``reference`` runs a stage's microbatches one after the other (forward, then backward of the
given output gradients), as a training loop without a pipeline would, and records after each
microbatch the input gradients, every parameter's ``.grad`` and the order in which parameter
hooks fired. Autograd keeps a view of a gradient as ``.grad`` without looking at what else
shares its memory, so two parameters added through views of one tensor (``h + a.view(s) +
b.view(s)``) end up with one memory as ``.grad``, and the next microbatch is added to it twice;
the reference gives each ``.grad`` its own memory after every microbatch (as the split does),
and autograd works on copies of the output gradients, whose memory a ``.grad`` could share too.

``split`` runs a copy of the stage through the runtime's passes (F, then B, then W, or a fused
BW) in a pipeline order with several microbatches in flight, and records the same things after
each microbatch's last backward pass. ``assert_same`` compares them bit for bit.

Activations are checked at every F against the hooks-only meter: a shadow copy of the stage runs
each forward unsplit under the saved-tensor hooks (``ActivationMeter(replay=False)``) while the
split pass is alive, and each F must add the same bytes to the split's meter as to the shadow's;
B may only free, and nothing is left once every W has run.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zbsearch.runtime import backward_full, backward_input, backward_weight, forward_pass
from zbsearch.runtime.memory import ActivationMeter

__all__ = ["Outcome", "reference", "split", "pipeline_order", "assert_same", "leaf", "Hooked"]


@dataclass
class Outcome:
    """What one run left after each microbatch's backward (index: microbatch)."""

    input_grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    param_grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    hooks: list[list[str]] = field(default_factory=list)  # hook events during that microbatch's backward


class Hooked:
    """Gradient hooks on every parameter of a module, recording their order: a tensor hook
    that doubles the gradient of every other parameter (and adds one event), and a
    post-accumulate hook."""

    def __init__(self, module: nn.Module, double: bool = True) -> None:
        self.events: list[str] = []
        self.handles = []
        for k, (name, p) in enumerate(module.named_parameters()):
            if not p.requires_grad:
                continue
            if double and k % 2 == 0:
                self.handles.append(p.register_hook(self._tensor_hook(name)))
            self.handles.append(p.register_post_accumulate_grad_hook(self._post_hook(name)))

    def _tensor_hook(self, name: str):
        def hook(g):
            self.events.append(f"grad {name}")
            return 2 * g

        return hook

    def _post_hook(self, name: str):
        def hook(p):
            self.events.append(f"accumulated {name} {p.grad.abs().sum().item():.6g}")

        return hook

    def take(self) -> list[str]:
        out, self.events = self.events, []
        return out


def leaf(t):
    """A fresh leaf of ``t``'s value: requiring grad where it is a floating tensor that did."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def reference(
    module: nn.Module, inputs: Sequence[Sequence], grads: Sequence[Sequence], post: Sequence[Callable | None] | None = None,
    hooks: Hooked | None = None,
) -> Outcome:
    """Microbatch after microbatch: forward, ``torch.autograd.backward`` of the output gradients."""
    out = Outcome()
    for j, (xs, gs) in enumerate(zip(inputs, grads)):
        xs = [leaf(x) for x in xs]
        y = module(*xs)
        if post is not None and post[j] is not None:
            y = post[j](y)
        ys = y if isinstance(y, (tuple, list)) else (y,)
        pairs = [(o, g) for o, g in zip(ys, gs) if g is not None and o.requires_grad]
        if pairs:  # copies of the caller's gradients, and of the input gradients below: autograd
            # can make a parameter's .grad a view of either, and add later microbatches to it in place
            torch.autograd.backward([o for o, _ in pairs], [g.clone() for _, g in pairs])
        for p in module.parameters():  # each .grad its own memory (the module docstring)
            if p.grad is not None:
                p.grad = p.grad.clone()
        out.input_grads.append([x.grad.clone() if isinstance(x, torch.Tensor) and x.grad is not None else None
                                for x in xs])
        out.param_grads.append(_snapshot(module))
        out.hooks.append(hooks.take() if hooks is not None else [])
    return out


def pipeline_order(rng: random.Random, m: int, fuse: float = 0.0) -> list[tuple[str, int]]:
    """A random order of the passes of m microbatches on one stage as a schedule may run them:
    F, B and W each in microbatch order, F before B before W of a microbatch, some microbatches
    fused (``"BW"``, in place of B; their W is dropped). The passes that accumulate gradients
    (W, BW) come in microbatch order, as in every schedule."""
    fused = {j for j in range(m) if rng.random() < fuse}
    nxt = {"F": 0, "B": 0, "W": 0}
    order: list[tuple[str, int]] = []
    while nxt["W"] < m:
        ready = []
        if nxt["F"] < m:
            ready.append("F")
        b = nxt["B"]
        if b < nxt["F"] and (b not in fused or nxt["W"] == b):  # a BW accumulates: every W before it first
            ready.append("B")
        if nxt["W"] < nxt["B"]:
            ready.append("W")
        op = rng.choice(ready)
        j = nxt[op]
        nxt[op] += 1
        if op == "B" and j in fused:
            order.append(("BW", j))
            nxt["W"] = j + 1
        else:
            order.append((op, j))
    return order


def split(
    module: nn.Module, inputs: Sequence[Sequence], grads: Sequence[Sequence], order: Sequence[tuple[str, int]],
    post: Sequence[Callable | None] | None = None, hooks: Hooked | None = None, deferred_first: bool = False,
    meter_check: bool = True,
) -> Outcome:
    """The runtime's passes on ``module`` in ``order`` (``pipeline_order``)."""
    m = len(inputs)
    out = Outcome(input_grads=[[]] * m, param_grads=[{}] * m, hooks=[[]] * m)
    meter = ActivationMeter()
    shadow_meter = ActivationMeter(replay=False)
    shadow_module = copy.deepcopy(module) if meter_check else None
    fused = {j for op, j in order if op == "BW"}
    passes, weights, shadows = {}, {}, {}
    in_b: set[int] = set()
    for op, j in order:
        if op == "F":
            xs = [leaf(x) for x in inputs[j]]
            p = post[j] if post is not None else None
            before, rng = meter.bytes, torch.get_rng_state()
            passes[j] = forward_pass(module, xs, split=j not in fused, post=p, meter=meter, deferred_first=deferred_first)
            if shadow_module is not None:
                shadow_before = shadow_meter.bytes
                with torch.random.fork_rng(devices=[]):  # the same random draws, and the next forward's unchanged
                    torch.set_rng_state(rng)
                    shadows[j] = forward_pass(shadow_module, [leaf(x) for x in inputs[j]], split=False, post=p,
                                              meter=shadow_meter)
                added, expected = meter.bytes - before, shadow_meter.bytes - shadow_before
                assert added == expected, f"F{j} saved {added} bytes of activations, unsplit {expected}"
        elif op == "BW":
            out.input_grads[j] = backward_full(passes.pop(j), grads[j])
        elif op == "B":
            before = meter.bytes
            fp = passes.pop(j)
            out.input_grads[j], weights[j] = backward_input(fp, grads[j])
            assert meter.bytes <= before, f"B{j} grew the activations"
            if fp.whole_in_b:
                in_b.add(j)
        else:
            backward_weight(weights.pop(j))
        # after the pass that accumulated the microbatch's gradients: W, a BW, or a B that ran the
        # whole backward (a reentrant checkpoint in the stage)
        if op == "BW" or (op == "W" and j not in in_b) or (op == "B" and j in in_b):
            out.param_grads[j] = _snapshot(module)
            out.hooks[j] = hooks.take() if hooks is not None else []
        if shadow_module is not None and (op == "BW" or op == "W"):
            shadows.pop(j).saved.free()
    assert not passes and not weights
    assert meter.bytes == 0, f"{meter.bytes} bytes of activations left after every W"
    return out


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same(got: Outcome, want: Outcome, what: str = "") -> None:
    """Bit for bit: input gradients, every ``.grad`` after every microbatch, hook events."""
    for j, (g, w) in enumerate(zip(got.input_grads, want.input_grads)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert _equal(a, b), f"{what} microbatch {j}: gradient of input {i} differs" + _diff(a, b)
    for j, (g, w) in enumerate(zip(got.param_grads, want.param_grads)):
        for name in w:
            assert _equal(g[name], w[name]), f"{what} microbatch {j}: {name}.grad differs" + _diff(g[name], w[name])
    for j, (g, w) in enumerate(zip(got.hooks, want.hooks)):
        assert sorted(g) == sorted(w), f"{what} microbatch {j}: hooks fired {g}, loss.backward() fires {w}"


def _diff(a, b) -> str:
    if a is None or b is None:
        return f" ({'None' if a is None else 'a tensor'} vs {'None' if b is None else 'a tensor'})"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f" ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})"
    return f" (max |difference| {(a.double() - b.double()).abs().max().item():.3g})"
