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

A parameter without ``.grad`` gets its microbatch's gradient as ``.grad`` itself where nothing
else holds it, as autograd's accumulator takes it, and a copy anywhere else (``_own``): a
gradient is often a tensor other code still reads (an input gradient sent to another stage, a
gradient autograd passed on unchanged to two parameters, a piece of a later W), and ``.grad``
is added to in place by the next microbatch. Which tensors hold one is only known once W's own
containers have let go of it, so those gradients are set at the end of W (``Uses.finish``).

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
import sys
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
    comes in (so none waits in memory longer), then ``finish()``: the parameters that had no
    ``.grad``, and those with hooks.

    ``params``: every piece to come, one entry per piece (a parameter as often as it has pieces).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._left: dict[int, int] = {}  # pieces still to come, per parameter
        for p in params:
            self._left[id(p)] = self._left.get(id(p), 0) + 1
        self._parts: dict[int, list[tuple[tuple, torch.Tensor]]] = {}
        self._hooked: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._new: list[nn.Parameter] = []  # parameters without .grad, and (apart) their gradients
        self._new_grads: list[torch.Tensor] = []

    def add(self, p: nn.Parameter, g: torch.Tensor | None, key: tuple) -> None:
        """One piece (None: no gradient reached that use) at ``key`` in the order of uses."""
        k = id(p)
        left = self._left[k] = self._left[k] - 1
        parts = self._parts.get(k)
        if not left and parts is None:  # its only piece (or the others had no gradient)
            if g is not None:
                self._done(p, g)
            return
        if g is not None:
            if parts is None:
                parts = self._parts[k] = []
            parts.append((key, g))
        if left:
            return
        assert parts is not None  # the last piece: the first branch took it unless others came before
        del self._parts[k]
        parts.sort(key=_autograd_order)
        total = parts[0][1]
        with torch.no_grad():
            for _, part in parts[1:]:
                total = total + part
        self._done(p, total)

    def _done(self, p: nn.Parameter, total: torch.Tensor) -> None:
        if p._backward_hooks or p._post_accumulate_grad_hooks:  # hooks registered from Python
            self._hooked.append((p, total))
        elif p.grad is not None:
            p.grad.add_(total)
        elif _may_own(total, p):  # whether something else holds it is known at the end of W
            self._new.append(p)
            self._new_grads.append(total)
        else:
            p.grad = _copy(total, p)

    def finish(self) -> None:
        """Set the gradients of the parameters that had no ``.grad`` (each itself where nothing
        else holds it, else a copy), then accumulate those of the parameters with hooks, through
        autograd. Called once W's pieces are all in and its own containers hold none of them."""
        params, grads = self._new, self._new_grads
        self._new, self._new_grads = [], []
        while params:
            p = params.pop()
            p.grad = _own(grads, p)
        if self._hooked:
            engine.backward([p for p, _ in self._hooked], [g for _, g in self._hooked])
            self._hooked = []


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory, each once, in some order of dimensions."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _may_own(g: torch.Tensor, p: nn.Parameter) -> bool:
    """Whether ``g`` could become ``p.grad`` as it is, holders aside: a plain dense tensor with
    no history, laid out as autograd lays out a ``.grad`` (the parameter's strides where it is
    dense, else contiguous), that fills its memory (owning it keeps nothing else alive)."""
    if (type(g) is not torch.Tensor or g.layout != torch.strided or g.requires_grad or g.is_conj() or g.is_neg()
            or g.dtype != p.dtype or g.device != p.device or g.shape != p.shape or g.numel() == 0):
        return False
    if _dense(p):
        if any(g.stride(d) != p.stride(d) if n != 1 else g.stride(d) == 0 for d, n in enumerate(g.shape)):
            return False
    elif not g.is_contiguous():
        return False
    return g.storage_offset() == 0 and g.untyped_storage().nbytes() == g.numel() * g.element_size()


def _holders(box: list[torch.Tensor]) -> tuple[int, ...]:
    """How many references hold the last tensor in ``box`` (taken out, then put back): from
    Python and from C++, to its memory, to the memory's Python object, and to the tensor it is a
    view of. Compared with the counts of a tensor that ``box`` alone holds (``_ALONE``)."""
    g = box.pop()
    s = g.untyped_storage()
    counts: tuple[int, ...] = (
        sys.getrefcount(g), g._use_count(), torch._C._storage_Use_Count(s._cdata), sys.getrefcount(s),  # type: ignore[attr-defined]
    )
    if g._is_view():
        b = g._base
        assert b is not None  # a view has a base
        counts += (sys.getrefcount(b), b._use_count())  # type: ignore[attr-defined]
        del b
    box.append(g)
    return counts


def _alone() -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``_holders`` of a tensor and of a view of a tensor that nothing else holds (the counts
    depend on the interpreter and on torch); None where torch does not tell."""
    if not hasattr(torch.Tensor, "_use_count") or not hasattr(torch._C, "_storage_Use_Count"):
        return None
    return _holders([torch.empty(1)]), _holders([torch.empty(1).view(1)])


_ALONE = _alone()


def _own(box: list[torch.Tensor], p: nn.Parameter) -> torch.Tensor:
    """The last gradient in ``box`` (taken out) as ``p``'s new ``.grad``: the tensor itself (a
    view: its memory, as a tensor of its own) where ``box`` alone holds it and its memory, as
    autograd's accumulator takes a gradient nothing else references; else a copy. Anything else
    holding it could read it after the next microbatch adds to ``.grad`` in place, or write it."""
    if _ALONE is not None and _holders(box) == _ALONE[box[-1]._is_view()]:
        g = box.pop()
        if not g._is_view():
            return g
        mine = torch.empty(0, dtype=g.dtype, device=g.device)
        return mine.set_(g.untyped_storage(), 0, g.shape, g.stride())
    return _copy(box.pop(), p)


def _copy(g: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """A copy of ``g`` laid out as autograd lays out a new ``.grad``: the parameter's strides
    where it is dense, else contiguous."""
    g = g.detach()
    if _dense(p):  # ``new_empty_strided``: a tensor subclass (a DTensor) stays one, laid out as its parameter
        return g.new_empty_strided(p.shape, p.stride()).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


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
