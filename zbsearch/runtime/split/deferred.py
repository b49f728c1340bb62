"""The fast path: Linear weight gradients deferred to W, everything else in one autograd call.

Most parameter uses in a transformer are ``F.linear`` (``nn.Linear``, attention and MLP
projections, tied heads), whose weight gradient is a matrix product, and elementwise or norm
uses (LayerNorm / RMSNorm weights, biases, a position table), whose gradient costs
O(activations). The fast path needs no graph analysis:

* ``F.linear`` on a stage parameter runs as ``LinearInputGrad``, a custom autograd Function
  whose backward computes the input gradient only and keeps (input, output gradient); W
  computes the weight gradient from those (one matrix product and, for a bias, a sum).
* Its forward is ``F.linear`` itself on the stage's own parameters, so the output is bit for bit
  the unsplit one, and its gradients are computed as autograd's matrix-product backward
  computes them for the layout at hand (a column-major input, a non-contiguous weight, a bias
  added inside ``addmm`` or after the product), from the same 2-D input the product read (a
  view, or the copy ``F.linear`` makes of an input no view can fold: the meter then counts what
  autograd would have saved). Where ``F.linear``'s output is a view (an input of more than two
  dimensions is folded into a matrix), the Function returns the same tensor as no view
  (``_unsafe_view``, as ``torch.matmul`` does): autograd forbids in-place changes
  (``F.relu(h, inplace=True)``, ``h += x``) to a view made inside a custom Function.
* B is one ``autograd.grad`` without ``retain_graph`` for the input gradients, every deferred
  Linear's output gradient and every parameter's gradient from its other uses: the graph, and
  every activation W does not read, is freed as it goes. W adds those gradients to ``.grad``
  after its products (``accumulation``), so that gradients add up over microbatches in the
  same order whichever path each took.

Nothing is deferred under autocast (its casts would have to be replayed in W) or inside other
saved-tensor hooks than the split's (``torch.utils.checkpoint``, ``save_on_cpu``): those hooks
expect what the unsplit call saves (a checkpoint's recomputation in backward checks it).

The forward runs under ``DeferOnly``, a ``TorchFunctionMode`` that intercepts ``F.linear`` and
nothing else (every torch call through a Python handler costs microseconds). Which stages may
take the path, and which Linears it leaves alone, is decided on the first microbatch of each
input signature (``passes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch._C._autograd import _top_saved_tensors_default_hooks
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .. import engine
from ..memory import SavedActivations
from .accumulation import PREFIX, TensorHooksPaused, Uses

__all__ = ["Deferral", "DeferOnly", "deferrable", "ours", "fast_input"]

_DTensor: type | None = None
if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor as _DTensor


class _Record:
    """One deferred ``F.linear``: what B and W need of it.

    ``x`` holds the input as the matrix product reads it (2-D). ``fused``: ``F.linear`` adds the
    bias inside its product (``addmm``; else the product, then an add whose bias gradient sums
    over every leading dimension). ``key``: its place in the order of the parameters' uses."""

    __slots__ = ("weight", "bias", "x", "grad", "fused", "version", "key")

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, fused: bool, key: tuple) -> None:
        self.weight, self.bias, self.fused, self.key = weight, bias, fused, key
        self.x = None
        self.grad: torch.Tensor | None = None
        self.version = weight._version


class LinearInputGrad(torch.autograd.Function):
    """``F.linear`` whose backward gives the input gradient only and leaves the output gradient
    in ``rec`` for W. The weight and bias are no inputs of the Function (their gradients are
    W's); ``anchor`` (a leaf) keeps the output in the graph where the input needs no gradient
    (a Linear on data), and makes B run every deferred Linear: B asks for the anchor's gradient."""

    @staticmethod
    def forward(ctx, x, anchor, rec, saved):
        """The Linear's output, with its input kept for W and its weight gradient deferred."""
        ctx.rec, ctx.shape = rec, x.shape
        out = F.linear(x, rec.weight, rec.bias)  # the parameters themselves: the unsplit call's path
        x2 = x.unsqueeze(0) if x.dim() == 1 else x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rec.x = saved.hold(x2)
        # the input gradient is computed as autograd's matrix-product backward does for this layout
        ctx.column_major = x2.stride(0) == 1 and x2.stride(1) == x2.shape[0] and x2.shape[1] > 1
        if out._base is not None:  # F.linear's unfolded product: the same tensor, as no view
            out = torch.ops.aten._unsafe_view(out._base, out.shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        """B's part: the input gradient only, checked against in-place changes to the weight."""
        rec = ctx.rec
        w = rec.weight  # no graph is built here: autograd runs backward without grad mode
        if w._version != rec.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"the weight {tuple(w.shape)} of a Linear is at version {w._version}; expected version {rec.version} instead"
            )
        rec.grad = grad
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if ctx.column_major:  # a 2-D view of the input, column-major: as autograd computes it then
            gx = w.t().mm(grad.reshape(-1, grad.shape[-1]).t()).t().reshape(ctx.shape)
        else:
            gx = grad.matmul(w)  # folds a gradient of more than two dimensions into one product
        return gx, None, None, None


def weight_grad(w: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """A Linear's weight gradient as autograd's matrix-product backward computes it from the
    output gradient and the input as 2-D matrices (``weight.t()`` is the product's operand)."""
    stride = w.stride()
    if stride[1] == 1 and stride[0] == w.shape[1]:
        return g2.t().mm(x2)
    return x2.t().mm(g2).t()


def bias_grad(g: torch.Tensor, g2: torch.Tensor, fused: bool) -> torch.Tensor:
    """A Linear's bias gradient as autograd sums it: over the rows of the product's gradient
    (``addmm``), or over every leading dimension of the output's (an add after the product)."""
    if fused:
        return g2.sum(0)
    if g.dim() == 1:
        return g.clone()
    return g.sum(tuple(range(g.dim() - 1)))


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> list | None:
    """The arguments in ``names`` order (defaults for the trailing ones); None for a call
    this path does not know."""
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    required = len(names) - len(defaults)
    out = []
    for i, n in enumerate(names):
        if i < len(args):
            if n in kwargs:
                return None
            out.append(args[i])
        elif n in kwargs:
            out.append(kwargs[n])
        elif i >= required:
            out.append(defaults[i - required])
        else:
            return None
    return out


_LINEAR_ARGS = (("input", "weight", "bias"), (None,))


def deferrable(func, args: tuple, kwargs: dict, params: dict[int, nn.Parameter]) -> tuple | None:
    """``(x, weight, bias)`` of an ``F.linear`` call the split may defer: on the stage's own
    parameters, a plain input, not under autocast; else None."""
    if func is not F.linear:
        return None
    a = _bind(args, kwargs, *_LINEAR_ARGS)
    if a is None:
        return None
    x, w, b = a
    if not isinstance(w, nn.Parameter) or params.get(id(w)) is not w or w.dim() != 2:
        return None
    if b is not None and (not isinstance(b, nn.Parameter) or params.get(id(b)) is not b or b.dim() != 1):
        return None
    kind = _kind(x)
    if kind is None or _kind(w) != kind or (b is not None and _kind(b) != kind):
        return None
    if x.dim() == 0 or torch.is_autocast_enabled(x.device.type):
        return None
    return x, w, b


def _kind(t: torch.Tensor) -> type | None:
    """``torch.Tensor`` for a plain tensor or parameter, ``DTensor`` for a DTensor (tensor
    parallelism: autograd and the products below run on it as on a plain tensor, each rank on
    its shards); None for any other subclass, which the fast path leaves alone."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return torch.Tensor
    if _DTensor is not None and type(t) is _DTensor:
        return _DTensor
    return None


def ours(pack: Callable) -> bool:
    """Whether the saved-tensor hooks in force are the split's (``pack`` theirs)."""
    top = _top_saved_tensors_default_hooks(False)
    return top is not None and top[0] == pack


class Deferral:
    """The deferred Linears of one forward. ``no_defer``: ids of parameters whose Linears the
    signature's verdict keeps undeferred."""

    def __init__(self, params: dict[int, nn.Parameter], saved: SavedActivations, no_defer: frozenset[int]) -> None:
        self._params = params
        self._no_defer = no_defer
        self.saved = saved
        self.pack = saved.pack_hook
        self.anchor = torch.empty(0, requires_grad=True)
        self.records: list[_Record] = []

    def call(self, func, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """``func``'s output, deferred, or None when it is not a use this path takes."""
        a = deferrable(func, args, kwargs, self._params)
        if a is None or not ours(self.pack):
            return None
        return self.defer(a, (len(self.records), 0))

    def defer(self, a: tuple, key: tuple) -> torch.Tensor | None:
        """``F.linear(*a)`` deferred at ``key`` in the order of uses (None: not this one)."""
        x, w, b = a
        if id(w) in self._no_defer or (b is not None and id(b) in self._no_defer):
            return None
        # as at::linear: the bias inside the product for a matrix or a contiguous input
        rec = _Record(w, b, b is not None and (x.dim() == 2 or x.is_contiguous()), key)
        out = LinearInputGrad.apply(x, self.anchor, rec, self.saved)
        self.records.append(rec)
        return out

    def holders(self) -> set[int]:
        """The saved activations W reads."""
        return {id(r.x) for r in self.records if self.saved.holds(r.x)}

    def pieces(self) -> list[nn.Parameter]:
        """The parameters W's products give a gradient to, once per product."""
        return [q for r in self.records for q in (r.weight, r.bias) if q is not None]

    def weight_grads(self, uses: Uses) -> None:
        """W of the deferred Linears: each weight's gradient from its input and output gradient,
        given to ``uses``. A product, then an add into ``.grad``, as autograd does: ``addmm_``
        into ``.grad`` would save the temporary but round differently. Without grad mode, as
        autograd computes gradients: the products read activations that are still in the graph,
        and under grad mode ``.grad`` would carry their history, keeping every microbatch's
        graph alive until the gradients are reset."""
        with torch.no_grad():
            for r in self.records:
                g = r.grad
                if g is None:  # no gradient reached this use
                    uses.add(r.weight, None, r.key)
                    if r.bias is not None:
                        uses.add(r.bias, None, r.key)
                    continue
                x = self.saved.read(r.x)
                g2 = g if g.dim() == 2 else g.reshape(-1, g.shape[-1])
                uses.add(r.weight, weight_grad(r.weight, g2, x), r.key)
                if r.bias is not None:
                    uses.add(r.bias, bias_grad(g, g2, r.fused), r.key)
        self.records = []


class DeferOnly(TorchFunctionMode):
    """The fast path's forward: deferred Linear calls, every other call as it is."""

    def __init__(self, deferral: Deferral) -> None:
        super().__init__()
        self._deferral = deferral

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            out = self._deferral.call(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def fast_input(
    outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], deferral: Deferral,
    params: list[nn.Parameter],
) -> tuple[list[torch.Tensor | None], list[tuple[nn.Parameter, torch.Tensor, tuple]]]:
    """B on the fast path: one autograd call, freeing the graph as it goes, for the gradients of
    ``inputs``, every deferred Linear's output gradient, and every parameter's gradient from its
    other uses (one piece per parameter, summed by autograd: ``PREFIX`` in the order of uses).
    Returns the input gradients and those pieces; frees every activation W does not read."""
    got: Sequence[torch.Tensor | None] = [None] * (len(inputs) + 1 + len(params))
    if outs:
        # Every parameter is asked for: those only deferred get nothing from their Linears (the
        # Function leaves their gradient to W) and cost nothing.
        with deferral.saved.consuming(), TensorHooksPaused(params):
            got = engine.grad(outs, [*inputs, deferral.anchor, *params], grads)
    deferral.saved.keep_only(deferral.holders())
    early = [(p, g, PREFIX) for p, g in zip(params, got[len(inputs) + 1:]) if g is not None]
    return list(got[: len(inputs)]), early
