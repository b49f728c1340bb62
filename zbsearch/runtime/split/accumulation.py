"""Parameter gradients added up bit for bit as ``loss.backward()`` adds them.

A split backward computes a parameter's gradient in pieces, one per use of the parameter
(a Linear's weight gradient in W, a norm's weight gradient in B, a tied weight's two uses in
different parts of the graph), where ``loss.backward()`` sums the uses in autograd's
accumulator and adds the sum to ``.grad`` once. Floating-point addition is not associative, so
the pieces must be summed in autograd's order, then added once:

* Autograd runs the nodes of a graph built in one thread in decreasing sequence number, so a
  parameter's uses reach it in reverse call order (within one call, in argument order), and
  it sums them as they arrive: ``((g_last + g_before) + ...)``. Every piece carries a key
  ``(call, argument)``; ``PREFIX`` marks a sum autograd made itself of uses that all reach the
  parameter before the others.
* Then one add into ``.grad`` (``.grad + (g1 + g2)``, not ``(.grad + g1) + g2``, which rounds
  differently once ``.grad`` holds earlier microbatches).

A parameter with gradient hooks of its own (``register_hook``,
``register_post_accumulate_grad_hook``) gets its microbatch's gradient through autograd's own
accumulator, in one engine call at the end of W, which runs them as ``loss.backward()`` would:
the tensor hooks on the summed gradient, then the add, then the post-accumulate hooks. While B
or W only capture a piece, its tensor hooks are paused (autograd would run them on the piece).
Parameters without hooks are added directly, which costs less than a pass through the engine.
Hooks registered in C++ on a parameter's accumulator node are not seen: they fire only where a
pass runs the accumulator itself (a fused BW, a first stage's plain backward).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .. import engine

__all__ = ["PREFIX", "Uses", "TensorHooksPaused"]

PREFIX = (math.inf, 0)


def _autograd_order(part: tuple) -> tuple:
    call, argument = part[0]
    return -call, argument


class Uses:
    """One W's pieces of parameter gradients, added to ``.grad`` as each parameter's last piece
    comes in (so none waits in memory longer), then ``finish()`` for those with hooks.

    ``params``: every piece to come, one entry per piece (a parameter as often as it has pieces).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._left: dict[int, int] = {}  # pieces still to come, per parameter
        for p in params:
            self._left[id(p)] = self._left.get(id(p), 0) + 1
        self._parts: dict[int, list[tuple[tuple, torch.Tensor, bool]]] = {}
        self._hooked: list[tuple[nn.Parameter, torch.Tensor]] = []

    def add(self, p: nn.Parameter, g: torch.Tensor | None, key: tuple, fresh: bool = False) -> None:
        """One piece (None: no gradient reached that use) at ``key`` in the order of uses;
        ``fresh``: a new tensor nothing else holds."""
        k = id(p)
        left = self._left[k] = self._left[k] - 1
        parts = self._parts.get(k)
        if not left and parts is None:  # its only piece (or the others had no gradient)
            if g is not None:
                self._done(p, g, fresh)
            return
        if g is not None:
            if parts is None:
                parts = self._parts[k] = []
            parts.append((key, g, fresh))
        if left:
            return
        assert parts is not None  # the last piece: the first branch took it unless others came before
        del self._parts[k]
        if len(parts) == 1:
            _, total, fresh = parts[0]
        else:
            parts.sort(key=_autograd_order)
            total = parts[0][1]
            with torch.no_grad():
                for _, part, _ in parts[1:]:
                    total = total + part
            fresh = True
        self._done(p, total, fresh)

    def _done(self, p: nn.Parameter, total: torch.Tensor, fresh: bool) -> None:
        if p._backward_hooks or p._post_accumulate_grad_hooks:  # hooks registered from Python
            self._hooked.append((p, total))
        else:
            _accumulate(p, total, fresh)

    def finish(self) -> None:
        """Accumulate the gradients of the parameters with hooks, through autograd."""
        if self._hooked:
            engine.backward([p for p, _ in self._hooked], [g for _, g in self._hooked])
            self._hooked = []


def _accumulate(p: nn.Parameter, g: torch.Tensor, fresh: bool) -> None:
    """Add ``g`` to ``p.grad``; ``fresh``: g is a new tensor nothing else holds."""
    if p.grad is None:
        # else a copy: g may alias a gradient still in use elsewhere
        p.grad = g if fresh and g.is_contiguous() else g.detach().clone(memory_format=torch.contiguous_format)
    else:
        p.grad.add_(g)


class TensorHooksPaused:
    """Parameters' tensor hooks (``register_hook``) kept from firing while B or W only capture a
    piece of a gradient (autograd runs a leaf's tensor hooks on a captured gradient too): they
    fire once, on the microbatch's whole gradient (``Uses.finish``)."""

    __slots__ = ("_paused",)

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._paused = [(d, dict(d)) for p in params if (d := p._backward_hooks)]

    def __enter__(self) -> None:
        for d, _ in self._paused:
            d.clear()

    def __exit__(self, *exc) -> None:
        for d, hooks in self._paused:
            d.clear()
            d.update(hooks)
