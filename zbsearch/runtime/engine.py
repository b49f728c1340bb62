"""Autograd's engine called without ``torch.autograd``'s per-call argument handling.

Every pass of the split backward is one or a few autograd calls, and ``torch.autograd.backward``
/ ``grad`` run Python on each before the engine starts (turning arguments into tuples, then for
every output a shape check through the symbolic-shapes helpers, a dtype check and the implicit
gradient of a scalar). Measured on one CPU thread: 14 µs a call in a tight loop on a tiny graph,
and 35-60 µs a call between real passes (the interpreter's caches cold after a forward), 3-4%
of a first stage's whole backward at hidden 64, which is one such call. The runtime's calls are regular: every
output gradient is a plain tensor (``_roots`` drops the None ones) of its output's shape, so
those checks always pass there. Where they hold, checked here in a few comparisons, the engine
is called as ``torch.autograd`` itself calls it (``torch.autograd.graph._engine_run_backward``,
which keeps the engine's logging hooks and context); anywhere else (a tensor subclass or an
active torch-function mode, a nested tensor, a gradient of another shape or of a complex dtype
where the output is real, a functorch transform, or a torch without that function) the public call runs, with its
checks and its error messages. Either way the engine receives the same arguments, so
gradients are the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.overrides import has_torch_function

__all__ = ["backward", "grad"]

_ENGINE: Callable[..., tuple] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _direct(outputs: Sequence, grads: Sequence, inputs: Sequence) -> bool:
    """Whether ``torch.autograd`` would hand these arguments to the engine unchanged."""
    if _ENGINE is None or len(outputs) != len(grads) or torch._C._are_functorch_transforms_active():
        return False
    if any(type(t) is not torch.Tensor for t in (*outputs, *grads)):
        return False
    # first (a mode would see the reads below): a torch-function mode, or an input that overrides
    if has_torch_function((*outputs, *(t for t in inputs if isinstance(t, torch.Tensor)))):
        return False
    return all(not o.is_nested and o.shape == g.shape and o.dtype.is_complex == g.dtype.is_complex
               for o, g in zip(outputs, grads))


def backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence = ()) -> None:
    """``torch.autograd.backward(outputs, grads, inputs=inputs or None)``: gradients accumulated
    into the leaves' ``.grad`` (``inputs``: only into those), the graph freed as it goes."""
    if _direct(outputs, grads, inputs):
        assert _ENGINE is not None
        _ENGINE(tuple(outputs), tuple(grads), False, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(outputs, grads, inputs=list(inputs) or None)


def grad(
    outputs: Sequence[torch.Tensor] | Sequence[GradientEdge],
    inputs: Sequence,
    grads: Sequence[torch.Tensor],
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=..., allow_unused=True)``."""
    if inputs and _direct(outputs, grads, inputs):
        assert _ENGINE is not None
        return _ENGINE(tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs), True, accumulate_grad=False)
    return torch.autograd.grad(outputs, inputs, grads, retain_graph=retain_graph, allow_unused=True)
