"""The backward pass split into B (input gradient) and W (weight gradient), for any module.

One forward builds one autograd graph. B asks autograd for the gradient of the stage inputs
only; autograd then runs just the nodes on a path from the outputs to the inputs, and inside
each node computes only the outputs that lead there (e.g. ``x @ w`` computes ``dx`` and not
``dw``). W has to finish the rest: the edges B skipped and the nodes that lead only to
parameters. How it does that without redoing B's work:

* The graph is cut in two: I, the nodes that reach a stage input, and Q, the nodes that reach a
  parameter but no input. A *frontier* node is a node of I with an edge into Q; the edges from
  the frontier into Q are exactly the weight work B skipped.
* During B a pre-hook on each frontier node saves the gradient arriving at it. W re-runs each
  frontier node from that saved gradient, asking for the parameter side only, so autograd
  computes just the frontier's edges into Q and then the Q nodes. This is what
  ``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight`` do;
  the differences below are ours.
* Every use of a parameter in forward gets its own identity view (a ``TorchFunctionMode`` swaps
  the parameter for ``p.view_as(p)`` in each call), and W asks for the gradient of those views,
  not of the parameter. Without this, W re-running the upper of two frontier nodes that share a
  parameter (a layer applied twice, tied weights) would also recompute the input-gradient path
  down to the lower one, because autograd runs every node on a path to a requested gradient.
  Frontier nodes whose Q parts still meet (a tensor derived from a parameter and used twice)
  are re-run together, with their saved gradients pinned by pre-hooks, which keeps the result
  exact; only then can W redo the input-gradient path between them.
* B frees the activations W does not read (see ``memory``), so memory follows the model:
  F allocates M_B, B frees M_B - M_W, W frees M_W.

A first stage (no input needs a gradient: token ids, data) is not split. Its B has no gradient
to send, so nothing waits for it: B only keeps the output gradients and W runs the whole
backward, which a first-stage W can do wherever its B could. The profile records what this
costs: T_B about 0 and no memory freed by B (m_b = 0), T_W the whole backward; schedules are
built from that. How W runs it is chosen per stage from measurement (``deferred_first``): one
plain backward (as torch's runtime does), or the split's B and W back to back, whose deferred
Linear weight gradients (below) cost less than autograd's on large layers. The profiler times
both and records the faster in the profile; the runtime follows it. In ``bench/split.py`` (one
CPU thread) it picked the deferred way on both models' first stages at hidden 1024 (Llama: 0.945
of a plain backward, torch's 0.993) and the plain one at hidden 64-256, where the fast path's
Python costs more (its W 1.16-1.22x the plain one at hidden 64). A module whose
``split_first_stage`` is true is split anyway: I is then the part of the graph that depends on
the inputs, found by following them through forward (the same ``TorchFunctionMode``), and B
runs it down to its lowest nodes, keeping the gradient arriving there. ``EmulatedStage`` asks
for that, so that an emulated first stage runs its profile's T_B in B whatever profile it
emulates.

Most of that machinery is for parameters used in arbitrary ways. The common layers get a fast
path with no graph analysis at all (measured in ``bench/split.py``):

* ``F.linear`` on a stage parameter (nn.Linear, the projections of attention and MLP, tied
  heads) runs as a custom autograd Function whose backward computes the input gradient only and
  keeps (input, output gradient); W computes the weight gradient from those later (one matrix
  product and, for a bias, a sum).
* Every other use of a parameter by an elementwise op or a norm layer (LayerNorm / RMSNorm
  weights, biases, a position table) costs O(activations), not a matrix product: B asks
  autograd for the gradient of those uses together with the input gradient, in one call, and
  W only adds them to ``param.grad`` (in W, like every other gradient, so that gradients add up
  over microbatches in the same order, bit for bit as ``loss.backward()`` per microbatch).
* So B is one ``autograd.grad`` without ``retain_graph`` (the graph, and every activation W does
  not read, is freed at once), and W is a few matrix products in Python.

Whether a stage takes it is decided per module and input signature on its first split
microbatch, which runs the generic split and checks the graph: every parameter use not deferred
must be cheap, and no parameter used directly (inside a custom autograd Function, say). Later
microbatches of that signature then run their forward under a lean mode that only intercepts
``F.linear`` (every torch call through a Python handler costs a few µs, and
the generic split's per-use views and data-flow tracking cost far more). Correctness does not
rest on the check: the fast B asks autograd for the gradient of every parameter, so a use the
first microbatch did not show still gets its gradient (in B, where it costs time, not
accuracy). A stage that does anything else keeps the generic split, which also handles the
deferred layers (their weight gradients are W's either way). A first stage whose W runs
deferred takes the fast path from its first microbatch, unchecked: its B's part runs in W too,
so a costly use computed there delays no other rank.

``backward_full`` is the fused BW: one ordinary backward, no analysis. Gradients accumulate
into ``param.grad`` like ``loss.backward()``. These functions are the ones the profiler times.
The forward before it (``forward_pass(split=False)``) runs the module as it is; while it runs,
``fused_forward()`` is true, so that an emulated stage can cost it as the profile's t_ff.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._C._autograd import _top_saved_tensors_default_hooks as _top_saved_tensors_hooks
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from . import engine
from .errors import PipelineError
from .footprint import forward_counted, see_signature
from .memory import ActivationMeter, SavedActivations

__all__ = [
    "ForwardPass", "forward_pass", "fused_forward", "backward_input", "backward_weight", "backward_full", "backward_in_w",
]

_FUSED_FORWARD = contextvars.ContextVar("zbsearch_fused_forward", default=False)


def fused_forward() -> bool:
    """Whether the forward running now is ``forward_pass(split=False)``'s: a microbatch whose
    backward will be one fused BW, run with none of the split's deferral."""
    return _FUSED_FORWARD.get()


class _DataFlow:
    """The tensors of a forward that depend on the stage inputs, and their places in the graph."""

    def __init__(self, inputs: Sequence) -> None:
        self._tensors = WeakIdKeyDictionary({t: True for t in inputs if isinstance(t, torch.Tensor)})
        self.edges: set[tuple[Node, int]] = set()  # (grad_fn, output_nr) of such tensors

    def note(self, args, kwargs, out) -> None:
        """After a call: its outputs depend on the inputs if an argument does."""
        if any([self.seen(t) for t in _tensors_in((args, kwargs))]):  # a list: seen() records every edge
            for t in _tensors_in(out):
                self._tensors[t] = True
                self.seen(t)

    def seen(self, t: torch.Tensor) -> bool:
        """Whether ``t`` depends on the inputs (recording its place in the graph)."""
        if t not in self._tensors:
            return False
        if t.grad_fn is not None:  # read at each use: a custom Function sets it after its forward
            self.edges.add((t.grad_fn, t.output_nr))
        return True


def _tensors_in(x) -> list[torch.Tensor]:
    found, stack = [], [x]
    while stack:
        y = stack.pop()
        if isinstance(y, torch.Tensor):
            found.append(y)
        elif isinstance(y, (list, tuple)):
            stack.extend(y)
        elif isinstance(y, dict):
            stack.extend(y.values())
    return found


# Parameter uses whose gradient is O(activations) (no matrix product): computed in B (fast path).
_CHEAP = frozenset({
    "layer_norm", "rms_norm", "group_norm", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__",
    "mul", "__mul__", "__rmul__", "div", "__truediv__", "__getitem__",
})


class _Record:
    """One deferred ``F.linear``: what B and W need of it.

    ``x`` holds the input as ``F.linear``'s matrix product reads it (a 2-D view of it, or the
    contiguous copy that product makes of an input no view can fold), so that B and W compute
    the gradients autograd would from the same tensors, and the meter counts what autograd
    would have saved. ``fused``: ``F.linear`` adds the bias inside its product (``addmm``; else
    the product, then an add whose bias gradient sums over every leading dimension)."""

    __slots__ = ("weight", "bias", "x", "grad", "fused", "version", "node", "deferral")

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, fused: bool, deferral: _Deferral) -> None:
        self.weight, self.bias, self.fused, self.deferral = weight, bias, fused, deferral
        self.x = None
        self.grad: torch.Tensor | None = None
        self.version = weight._version
        self.node: Node | None = None  # the Function's node in the graph


class _LinearInputGrad(torch.autograd.Function):
    """``F.linear`` whose backward gives the input gradient only and leaves the output gradient
    in ``rec`` for W (unless the pass's deferral says ``now``: then it returns the weight and
    bias gradients too, and autograd accumulates them as it would an unsplit Linear's).
    ``anchor`` (a leaf) keeps the output in the graph where the input needs no gradient (a
    Linear on data), and makes B run every deferred Linear: B asks for the anchor's gradient.

    The forward is ``F.linear`` itself on the stage's own parameters, so its output is bit for
    bit what the module computes unsplit. Where that output is a view (``F.linear`` folds an
    input of more than two dimensions into a matrix and unfolds its product), the Function
    returns the product and ``_Deferral.call`` unfolds it outside: autograd forbids in-place
    changes to a view made inside a custom Function, and stage code does them
    (``F.relu(h, inplace=True)``, ``h += x``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, rec, saved):
        ctx.rec, ctx.shape = rec, x.shape
        out = F.linear(x, weight, bias)
        x2 = x.unsqueeze(0) if x.dim() == 1 else x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rec.x = saved.hold(x2)
        # the input gradient is computed as autograd's matrix-product backward does for this layout
        ctx.column_major = x2.stride(0) == 1 and x2.stride(1) == x2.shape[0] and x2.shape[1] > 1
        base = out._base
        if base is not None:  # the product, whole and contiguous (checked by the caller)
            return base
        return out

    @staticmethod
    def backward(ctx, grad):
        rec = ctx.rec
        if rec.weight._version != rec.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"the weight {tuple(rec.weight.shape)} of a Linear is at version {rec.weight._version}; expected "
                f"version {rec.version} instead"
            )
        g2 = grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])
        gx = None
        if ctx.needs_input_grad[0]:
            w = rec.weight.detach()
            gx = w.t().mm(g2.t()).t() if ctx.column_major else g2.mm(w)
            gx = gx.view(ctx.shape) if gx.shape != ctx.shape else gx
        if not rec.deferral.now:
            rec.grad = grad
            return gx, None, None, None, None, None
        # the whole backward in one autograd call: the weight's gradients go to autograd
        x2 = rec.deferral.saved.read(rec.x)
        gb = None if rec.bias is None else _bias_grad(grad, g2, rec.fused)
        return gx, _weight_grad(rec.weight, g2, x2), gb, None, None, None


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


class _Deferral:
    """The deferred weight uses of one forward (``F.linear`` on a stage parameter)."""

    def __init__(self, params: dict[int, nn.Parameter], saved: SavedActivations) -> None:
        self._params = params
        self.saved = saved
        self._pack = saved.pack_hook
        self.anchor = torch.empty(0, requires_grad=True)
        self.records: list[_Record] = []
        self.now = False  # set by a backward that runs the pass whole: weight gradients to autograd

    def ours(self) -> bool:
        """Whether the activations saved now are the split's: inside other saved-tensor hooks
        (``torch.utils.checkpoint``'s, ``save_on_cpu``) calls run as they are, since those
        hooks (a checkpoint's recomputation, in backward) expect what the unsplit call saves."""
        top = _top_saved_tensors_hooks(False)
        return top is not None and top[0] == self._pack

    def call(self, func, args: tuple, kwargs: dict):
        """The output of ``func`` run deferred, or None when it is not a use this path takes
        (under autocast too: its casts would have to be replayed in W)."""
        if args and isinstance(args[0], torch.Tensor) and torch.is_autocast_enabled(args[0].device.type):
            return None
        if func is not F.linear:
            return None
        a = _bind(args, kwargs, *_LINEAR_ARGS)
        if a is None or not self._mine(a[1]) or not (a[2] is None or self._mine(a[2])) or not isinstance(a[0], torch.Tensor):
            return None
        x, w, b = a
        if w.dim() != 2 or (b is not None and b.dim() != 1) or x.dim() == 0 or type(x) is not torch.Tensor:
            return None
        if not self.ours():
            return None
        # as at::linear: the bias inside the product for a matrix or a contiguous input
        rec = _Record(w, b, b is not None and (x.dim() == 2 or x.is_contiguous()), self)
        out = _LinearInputGrad.apply(x, w, b, self.anchor, rec, self.saved)
        rec.node = out.grad_fn
        self.records.append(rec)
        if out.dim() != x.dim():  # the product of a folded input: unfolded here, outside the Function
            out = out.view(*x.shape[:-1], w.shape[0])
        return out

    def _mine(self, t) -> bool:
        return isinstance(t, nn.Parameter) and self._params.get(id(t)) is t

    def holders(self) -> set[int]:
        return {id(r.x) for r in self.records if self.saved.holds(r.x)}

    def nodes(self) -> set[Node]:
        return {r.node for r in self.records if r.node is not None}

    def weight_grads(self, uses: _Uses) -> None:
        """W of the deferred uses: each weight's gradient from its input and output gradient,
        given to ``uses``.
        A product, then an add into ``.grad``, as autograd does: ``addmm_`` into ``.grad`` would
        save the temporary but round differently, and gradients are kept bit for bit those of
        ``loss.backward()`` (post-validation's exactness rests on it). Without grad mode, as
        autograd computes gradients: the products read activations that are still in the graph,
        and under grad mode ``.grad`` would carry their history, keeping every microbatch's graph
        alive until the gradients are reset (memory growing microbatch after microbatch, and the
        page faults of a growing heap in every later pass)."""
        with torch.no_grad():
            for r in self.records:
                g = r.grad
                if g is None:  # no gradient reached this use
                    uses.add(r.weight, None)
                    if r.bias is not None:
                        uses.add(r.bias, None)
                    continue
                x = self.saved.read(r.x)
                g2 = g if g.dim() == 2 else g.reshape(-1, g.shape[-1])
                uses.add(r.weight, _weight_grad(r.weight, g2, x), fresh=True)
                if r.bias is not None:
                    uses.add(r.bias, _bias_grad(g, g2, r.fused), fresh=True)
        self.records = []


def _weight_grad(w: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """A Linear's weight gradient as autograd's matrix-product backward computes it from the
    output gradient and the input as 2-D matrices (``weight.t()`` is the product's operand)."""
    if w.stride(1) == 1 and w.stride(0) == w.shape[1]:
        return g2.t().mm(x2)
    return x2.t().mm(g2).t()


def _bias_grad(g: torch.Tensor, g2: torch.Tensor, fused: bool) -> torch.Tensor:
    """A Linear's bias gradient as autograd sums it: over the rows of the product's gradient
    (``addmm``), or over every leading dimension of the output's (an add after the product)."""
    if fused:
        return g2.sum(0)
    if g.dim() == 1:
        return g.clone()
    return g.sum(tuple(range(g.dim() - 1)))


class _ViewPerUse(TorchFunctionMode):
    """Replace each stage parameter by a fresh identity view in every torch call that uses it,
    and follow the inputs' data flow when ``data`` is given."""

    def __init__(
        self, params: dict[int, nn.Parameter], views: dict[Node, nn.Parameter], data: _DataFlow | None, deferral: _Deferral,
    ) -> None:
        super().__init__()
        self._params = params
        self._views = views
        self._data = data
        self._deferral = deferral
        self.heavy = False  # a parameter used by an op outside _CHEAP (and not deferred)
        self.opaque = False  # calls ran inside other saved-tensor hooks (see ``_Deferral.ours``)
        self._func = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():  # grad-free code needs no split
            return func(*args, **kwargs)
        if not self._deferral.ours():
            self.opaque = True
            out = func(*args, **kwargs)
            if self._data is not None:
                self._data.note(args, kwargs, out)
            return out
        out = self._deferral.call(func, args, kwargs)
        if out is not None:
            if self._data is not None:
                self._data.note(args, kwargs, out)
            return out
        self._func = getattr(func, "__name__", "")
        if self._func == "__get__":  # a property: p.shape is no use of p, p.T is
            out = func(*args)
            if isinstance(out, torch.Tensor) and id(args[0]) in self._params:
                args = (self._swap(args[0]),)
                out = func(*args)
        else:
            args = tuple(self._swap(a) for a in args)
            kwargs = {k: self._swap(v) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
        if self._data is not None:
            self._data.note(args, kwargs, out)
        return out

    def _swap(self, a):
        if isinstance(a, nn.Parameter):
            p = self._params.get(id(a))
            if p is not None:
                v = p.view_as(p)
                assert v.grad_fn is not None  # a view of a leaf that requires grad has one
                self._views[v.grad_fn] = p
                self.heavy = self.heavy or self._func not in _CHEAP
                return v
            return a
        if isinstance(a, (list, tuple)) and any(isinstance(x, nn.Parameter) for x in a):
            return type(a)(self._swap(x) for x in a)
        return a


class _DeferOnly(TorchFunctionMode):
    """The fast path's forward: deferred Linear calls, every other call as it is."""

    def __init__(self, deferral: _Deferral) -> None:
        super().__init__()
        self._deferral = deferral

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            out = self._deferral.call(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@dataclass(eq=False)
class ForwardPass:
    """One stage forward on one microbatch, and what its backward passes need."""

    inputs: tuple
    outputs: tuple[torch.Tensor, ...]
    params: list[nn.Parameter]
    saved: SavedActivations
    views: dict[Node, nn.Parameter]
    data: _DataFlow | None  # a first stage's data flow (its inputs need no gradient)
    deferral: _Deferral | None = None  # the deferred Linear uses (split only)
    fast: bool = False  # B takes the fast path: the signature checked, or calls inside other saved-tensor hooks
    heavy: bool = False  # a parameter used by an op that is neither deferred nor cheap
    # a first stage: B keeps the output gradients, W runs the whole backward (B's and W's
    # parts of the fast path if ``deferral``)
    whole_in_w: bool = False
    whole_in_b: bool = False  # B runs the whole backward (a reentrant checkpoint), W nothing
    verdict: Callable[[str], None] | None = None  # records how this signature runs, when this pass is its first
    # set by backward_input, consumed by backward_weight:
    groups: list[_WeightGroup] = field(default_factory=list)
    pending: tuple[Sequence, Sequence] = ((), ())  # whole_in_w: the outputs and their gradients
    early: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)  # fast path: from B, for W


@dataclass(eq=False)
class _WeightGroup:
    roots: list[GradientEdge]
    grads: list[torch.Tensor]
    pinned: list[tuple[Node, tuple]]  # frontier nodes re-run together: (node, saved grad)
    captures: dict[Node, nn.Parameter]  # where W collects gradients, and whose they are


def forward_pass(
    module: nn.Module,
    inputs: Sequence,
    *,
    split: bool = True,
    post: Callable | None = None,
    meter: ActivationMeter | None = None,
    deferred_first: bool = False,
) -> ForwardPass:
    """Run ``module(*inputs)`` (then ``post`` on its output, e.g. a loss) for a later backward.

    ``split=False`` is for a fused backward (BW): no per-use views, nothing to split. A first
    stage (no input needs a gradient) is not split either, unless ``module.split_first_stage``
    is true: its B has no gradient to send, so B does nothing and W runs the whole backward, as
    one plain backward or, with ``deferred_first``, as the split's B and W back to back.
    Outputs are returned as a tuple of tensors (``ForwardPass.outputs``).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    saved = SavedActivations(meter, module)
    views: dict[Node, nn.Parameter] = {}
    first = _first(inputs)
    in_w = split and backward_in_w(module, inputs)
    whole = in_w and not deferred_first  # one plain backward in W
    sig = _signature(inputs, post)
    see_signature(module, (sig, torch.is_grad_enabled(), torch.is_autocast_enabled(), module.training))
    in_b = split and not in_w and _CHECKED.get(module, {}).get(sig) == _WHOLE  # the whole backward in B
    whole = whole or (in_w and _CHECKED.get(module, {}).get(sig) == _WHOLE)
    if not split or whole or in_b:

        def run() -> tuple[torch.Tensor, ...]:
            token = _FUSED_FORWARD.set(not split)
            try:
                out = module(*inputs)
                return _as_tensors(out if post is None else post(out))
            finally:
                _FUSED_FORWARD.reset(token)

        if meter is None:  # nothing to count: no hooks
            outs = run()
        elif meter.replay:
            extra = _tensors_in((post.args, post.keywords)) if isinstance(post, functools.partial) else []
            outs = forward_counted(module, run, saved, inputs, extra)
        else:
            with saved.hooks():
                outs = run()
        return ForwardPass(tuple(inputs), outs, params, saved, views, None, whole_in_w=whole, whole_in_b=in_b)
    deferral = _Deferral({id(p): p for p in params}, saved)
    known = _CHECKED.setdefault(module, {})
    verdict = known.get(sig)
    check = None if verdict is not None else (lambda v: known.__setitem__(sig, v))
    # The fast path, with a lean forward: where checked, or where B's part runs in W anyway (no
    # use done in B there can delay a B that another rank waits for, and the path is exact for
    # any use, see the module docstring)
    if (in_w and verdict != _WHOLE) or verdict == _FAST:
        with saved.hooks(), _DeferOnly(deferral):
            out = module(*inputs)
            if post is not None:
                out = post(out)
        return ForwardPass(tuple(inputs), _as_tensors(out), params, saved, views, None, deferral, fast=True, whole_in_w=in_w,
                           verdict=check)
    data = _DataFlow(inputs) if first else None
    mode = _ViewPerUse({id(p): p for p in params}, views, data, deferral)
    with saved.hooks(), mode:
        out = module(*inputs)
        if post is not None:
            out = post(out)
    outs = _as_tensors(out)
    if data is not None:
        for t in outs:
            data.seen(t)  # an output's own place, in case no later call used it
    # calls inside other saved-tensor hooks: the fast path's B, which leaves their work to autograd
    return ForwardPass(tuple(inputs), outs, params, saved, views, data, deferral, fast=mode.opaque, heavy=mode.heavy,
                       verdict=check)


def backward_in_w(module: nn.Module, inputs: Sequence) -> bool:
    """Whether a split pass of ``module`` on ``inputs`` leaves its whole backward to W: a first
    stage (no input needs a gradient) that does not ask to be split (``split_first_stage``)."""
    return _first(inputs) and not getattr(module, "split_first_stage", False)


def _first(inputs: Sequence) -> bool:
    return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


# module -> {input signature: how its split passes run}: the fast path (every parameter use
# deferred or cheap, or inside other saved-tensor hooks), the generic split, or the whole backward
# in one autograd call (a reentrant ``torch.utils.checkpoint``, which refuses ``autograd.grad``)
_FAST, _GENERIC, _WHOLE = "fast", "generic", "whole"
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, str]] = weakref.WeakKeyDictionary()


def _signature(inputs: Sequence, post: Callable | None) -> tuple:
    return (post is None, tuple(
        (t.shape, t.stride(), t.dtype, t.requires_grad, t.device) if isinstance(t, torch.Tensor) else type(t) for t in inputs
    ))


def _as_tensors(out) -> tuple[torch.Tensor, ...]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for i, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            raise PipelineError(f"stage output {i} is a {type(t).__name__}; stages must return a tensor or a tuple of tensors")
    return tuple(outs)


def _roots(fp: ForwardPass, output_grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    if len(output_grads) != len(fp.outputs):
        raise PipelineError(f"{len(output_grads)} output gradients for {len(fp.outputs)} outputs")
    pairs = [(o, g) for o, g in zip(fp.outputs, output_grads) if g is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _grad_inputs(fp: ForwardPass) -> list[int]:
    return [i for i, t in enumerate(fp.inputs) if isinstance(t, torch.Tensor) and t.requires_grad]


def backward_full(fp: ForwardPass, output_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Fused backward (BW): input gradients returned, parameter gradients accumulated."""
    outs, grads = _roots(fp, output_grads)
    result = _backward_accumulating(fp, outs, grads, _grad_inputs(fp))
    _release(fp)
    return result


def _backward_accumulating(fp: ForwardPass, outs: Sequence, grads: Sequence, idx: list[int]) -> list[torch.Tensor | None]:
    """One autograd call over the whole graph, freeing it as it goes: the stage inputs'
    gradients returned, every other leaf's accumulated into its ``.grad``."""
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    if not idx:  # a first stage: no input gradient to keep apart (measured: a few µs of a 0.8 ms pass)
        if outs and fp.params:
            with fp.saved.consuming():
                engine.backward(outs, grads)
        return result
    xs = [fp.inputs[i] for i in idx]
    if outs:
        # As loss.backward() does: parameter gradients accumulate in place, without copies, and
        # the inputs' own .grad is borrowed to receive theirs. Naming the leaves (``inputs=``)
        # measured 5-8% slower, so only inputs that are not leaves (whose graph goes on into
        # another stage's) make us name them.
        before = [x.grad for x in xs]
        for x in xs:
            x.grad = None
        with fp.saved.consuming():
            engine.backward(outs, grads, () if all(x.is_leaf for x in xs) else xs + fp.params)
        for i, x, b in zip(idx, xs, before):
            result[i], x.grad = x.grad, b
    return result


def backward_input(fp: ForwardPass, output_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """B: the gradient of each stage input (None where an input needs none)."""
    outs, grads = _roots(fp, output_grads)
    if fp.whole_in_w:
        fp.pending = (outs, grads)
        return [None] * len(fp.inputs)
    if fp.whole_in_b:
        result = _backward_accumulating(fp, outs, grads, _grad_inputs(fp))
        _release(fp)
        return result
    return _split_input(fp, outs, grads)


def _split_input(fp: ForwardPass, outs: list, grads: list) -> list[torch.Tensor | None]:
    """B's work on a split pass: the input gradients, and what W needs kept."""
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    idx = _grad_inputs(fp)
    if fp.fast:
        if fp.verdict is not None:  # the first microbatch of its kind on the fast path
            whole = _reaches(outs, _REENTRANT)
            fp.verdict(_WHOLE if whole else _FAST)
            if whole:
                return _whole_in_b(fp, outs, grads, idx)
        return _fast_backward_input(fp, outs, grads, idx)
    if fp.data is None:  # I: what reaches the inputs
        input_nodes = {get_gradient_edge(fp.inputs[i]).node for i in idx}
    else:  # I: what depends on the inputs
        input_nodes = {n for n, _ in fp.data.edges}
    root_edges = [get_gradient_edge(o) for o in outs]
    graph = _Graph([e.node for e in root_edges], input_nodes, fp)
    if fp.verdict is not None:  # the first microbatch of its kind: may the next take the fast path?
        fp.verdict(_WHOLE if graph.reentrant else _GENERIC if fp.heavy or graph.direct else _FAST)
    if graph.reentrant:
        return _whole_in_b(fp, outs, grads, idx)
    # B also runs every deferred Linear (they lead to the anchor), leaving W their weights
    anchor = [fp.deferral.anchor] if fp.deferral is not None and fp.deferral.records else []
    # B stops at the inputs, or for a first stage at the lowest nodes of I, whose work is all W's
    if fp.data is None:
        targets = [fp.inputs[i] for i in idx]
    else:
        bottom = set(graph.bottom())
        targets = [GradientEdge(n, k) for n, k in fp.data.edges if n in bottom]
    saved_grads: dict[Node, tuple] = {}
    handles = [n.register_prehook(_saver(saved_grads, n)) for n in graph.frontier]
    try:
        b_roots = [(o, g) for o, e, g in zip(outs, root_edges, grads) if anchor or graph.in_i(e.node)]
        if b_roots and (targets or anchor):
            b_outs, b_grads = [o for o, _ in b_roots], [g for _, g in b_roots]
            got = engine.grad(b_outs, targets + anchor, b_grads, retain_graph=True)[: len(targets)]
            if fp.data is None:
                for i, g in zip(idx, got):
                    result[i] = g
            else:
                for e, g in zip(targets, got):
                    slots = list(saved_grads.get(e.node, ()))
                    slots += [None] * (e.output_nr + 1 - len(slots))
                    slots[e.output_nr] = g
                    saved_grads[e.node] = tuple(slots)
    finally:
        for h in handles:
            h.remove()
    fp.groups = graph.weight_groups(root_edges, grads, saved_grads)
    # Keep the activations W reads (those saved by the nodes it re-runs), free the others.
    with fp.saved.record() as keep:
        for node in graph.weight_nodes(fp.groups):
            _touch_saved(node)
    if fp.deferral is not None:
        keep |= fp.deferral.holders()
    fp.saved.keep_only(keep)
    fp.outputs = ()
    fp.inputs = ()
    return result


def _whole_in_b(fp: ForwardPass, outs: list, grads: list, idx: list[int]) -> list[torch.Tensor | None]:
    """B of a pass whose graph holds a reentrant ``torch.utils.checkpoint``: it refuses any autograd
    call that names its inputs (``autograd.grad``), so B runs the whole backward in one plain
    call, its deferred Linears' weight gradients given to autograd, and W has nothing left."""
    if fp.deferral is not None:
        fp.deferral.now = True
    try:
        result = _backward_accumulating(fp, outs, grads, idx)
    finally:
        if fp.deferral is not None:
            fp.deferral.now = False
            fp.deferral.records = []
    fp.saved.free()
    fp.whole_in_b = True
    fp.outputs = ()
    fp.inputs = ()
    return result


# a reentrant torch.utils.checkpoint's node (its backward calls autograd again)
_REENTRANT = "CheckpointFunctionBackward"


def _reaches(outs: Sequence[torch.Tensor], name: str) -> bool:
    """Whether the graph below ``outs`` has a node of that name."""
    seen: set[Node] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.name() == name:
            return True
        stack.extend(c for c, _ in n.next_functions if c is not None and c not in seen)
    return False


def _fast_backward_input(fp: ForwardPass, outs: list, grads: list, idx: list[int]) -> list[torch.Tensor | None]:
    """B on the fast path: one autograd call, freeing the graph as it goes, for the input
    gradients, every deferred layer's output gradient and the gradients of the other parameter
    uses (the cheap ones, and any the check did not see: exact, in B rather than W). Those are
    added to ``.grad`` in W, as on the generic path, so that gradients accumulate over
    microbatches in the same order whichever path each took (bit for bit ``loss.backward()``)."""
    assert fp.deferral is not None
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    # Every parameter is asked for: those only deferred are not reached (their weight comes in
    # detached) and cost nothing.
    targets = [fp.inputs[i] for i in idx] + [fp.deferral.anchor] + fp.params
    if outs:
        with fp.saved.consuming(), _TensorHooksPaused(fp.params):
            got = engine.grad(outs, targets, grads)
        for i, g in zip(idx, got):
            result[i] = g
        fp.early = [(p, g) for p, g in zip(fp.params, got[len(idx) + 1:]) if g is not None]
    fp.saved.keep_only(fp.deferral.holders())
    fp.outputs = ()
    fp.inputs = ()
    return result


def backward_weight(fp: ForwardPass) -> None:
    """W: accumulate the parameter gradients left by ``backward_input``."""
    if fp.whole_in_b:
        _release(fp)
        return
    if fp.whole_in_w:
        outs, grads = fp.pending
        fp.pending = ((), ())
        if fp.deferral is None:  # one plain backward: no deferred, early or grouped gradients
            _backward_accumulating(fp, outs, grads, [])
            _release(fp)
            return
        _split_input(fp, list(outs), list(grads))  # B's part first, then W's as on any split pass
    records = fp.deferral.records if fp.deferral is not None else []
    uses = _Uses(
        [q for r in records for q in (r.weight, r.bias) if q is not None]
        + [p for p, _ in fp.early] + [p for g in fp.groups for p in g.captures.values()]
    )
    if fp.deferral is not None:
        fp.deferral.weight_grads(uses)
    for p, g in fp.early:
        uses.add(p, g)
    for group in fp.groups:
        handles = [n.register_prehook(_pin(g)) for n, g in group.pinned] if len(group.pinned) > 1 else []
        try:
            with _TensorHooksPaused(group.captures.values()):
                got = engine.grad(group.roots, [GradientEdge(n, 0) for n in group.captures], group.grads, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        for p, pg in zip(group.captures.values(), got):
            uses.add(p, pg)
    uses.finish()
    _release(fp)


class _Uses:
    """Adds each parameter's gradients into its ``.grad`` as autograd does: the gradients of a
    parameter's uses summed first, then one add (``.grad + (g1 + g2)``, not
    ``(.grad + g1) + g2``, which rounds differently once ``.grad`` holds earlier microbatches).
    A parameter used once is added at once, so no gradient waits in memory. Uses add up in the
    order given: with more than two, autograd's order (the order gradients reach the
    parameter) may differ.

    A parameter with gradient hooks of its own (``register_hook``,
    ``register_post_accumulate_grad_hook``) gets its microbatch's gradient through autograd's
    own accumulator, in one engine call at the end of W (``finish``), which runs them as
    ``loss.backward()`` would: the tensor hooks on the summed gradient, then the add, then the
    post-accumulate hooks. Others are added here, which costs a few µs less per parameter than
    a pass through the engine."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._left: dict[int, int] = {}  # uses still to come, per parameter
        for p in params:
            self._left[id(p)] = self._left.get(id(p), 0) + 1
        self._sums: dict[int, tuple[torch.Tensor, bool]] = {}
        self._hooked: list[tuple[nn.Parameter, torch.Tensor]] = []

    def add(self, p: nn.Parameter, g: torch.Tensor | None, fresh: bool = False) -> None:
        """One use's gradient (None: no gradient reached it); ``fresh``: a new tensor nothing
        else holds."""
        k = id(p)
        self._left[k] -= 1
        if k in self._sums:
            if g is not None:
                with torch.no_grad():
                    g, fresh = self._sums[k][0] + g, True
            else:
                g, fresh = self._sums[k]
            del self._sums[k]
        if g is None:
            return
        if self._left[k]:
            self._sums[k] = (g, fresh)
        elif _has_hooks(p):
            self._hooked.append((p, g))
        else:
            _accumulate(p, g, fresh)

    def finish(self) -> None:
        """Accumulate the gradients of the parameters with hooks, through autograd."""
        if self._hooked:
            engine.backward([p for p, _ in self._hooked], [g for _, g in self._hooked])
            self._hooked = []


def _has_hooks(p: torch.Tensor) -> bool:
    """Whether ``p`` has gradient hooks registered from Python."""
    return bool(p._backward_hooks) or bool(p._post_accumulate_grad_hooks)


class _TensorHooksPaused:
    """Parameters' tensor hooks (``register_hook``) kept from firing while B or W only capture a
    gradient (autograd runs a leaf's tensor hooks on a captured gradient too): they fire once,
    when W accumulates the microbatch's whole gradient (``_Uses.finish``)."""

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


def _release(fp: ForwardPass) -> None:
    fp.saved.free()
    fp.groups = []
    fp.pending = ((), ())
    fp.early = []
    fp.deferral = None
    fp.views = {}
    fp.data = None
    fp.outputs = ()
    fp.inputs = ()


def _accumulate(p: nn.Parameter, g: torch.Tensor | None, fresh: bool = False) -> None:
    """Add ``g`` to ``p.grad``; ``fresh``: g is a new tensor nothing else holds."""
    if g is None:
        return
    if p.grad is None:
        # else a copy: g may alias a gradient still in use elsewhere
        p.grad = g if fresh and g.is_contiguous() else g.detach().clone(memory_format=torch.contiguous_format)
    else:
        p.grad.add_(g)


def _saver(store: dict, node: Node):
    def hook(grad_outputs):
        store[node] = grad_outputs

    return hook


def _pin(saved: tuple):
    return lambda grad_outputs: saved


def _touch_saved(node: Node) -> None:
    for name in _saved_names(type(node)):
        getattr(node, name)
    getattr(node, "saved_tensors", None)  # a custom autograd.Function's context


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(cls: type) -> tuple[str, ...]:
    names = _SAVED_NAMES.get(cls)
    if names is None:
        names = _SAVED_NAMES[cls] = tuple(n for n in dir(cls) if n.startswith("_saved_"))
    return names


class _Graph:
    """The autograd graph of one stage forward, classified for the B/W split.

    Nodes are classified bottom-up: ``reach_i`` (a path to a stage input: the set I) and
    ``reach_q`` (a path to a capture point, where W collects parameter gradients). Q is
    reach_q minus I.
    """

    def __init__(self, roots: list[Node], input_nodes: set[Node], fp: ForwardPass) -> None:
        views = fp.views
        # Each view's only child is its parameter's accumulator; unviewed parameters need a lookup.
        param_acc: dict[Node, nn.Parameter] = {}
        for v, p in views.items():
            acc = v.next_functions[0][0]
            assert acc is not None  # the parameter requires grad, so it has an accumulator
            param_acc[acc] = p
        viewed = {id(p) for p in views.values()}
        param_acc.update({get_gradient_edge(p).node: p for p in fp.params if id(p) not in viewed})
        children: dict[Node, list[Node]] = {}
        order: list[Node] = []  # children before parents
        direct: set[int] = set()  # parameters some node uses without a per-use view
        deferred = fp.deferral.nodes() if fp.deferral is not None else set()
        self.reentrant = False
        stack = [(r, False) for r in roots]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
            elif node not in children:
                kids = [c for c, _ in node.next_functions if c is not None]
                if node in deferred:  # its weight and bias gradients are W's, not the graph's
                    kids = [c for c in kids if c not in param_acc]
                elif node.name() == _REENTRANT:
                    self.reentrant = True
                children[node] = kids
                stack.append((node, True))
                for c in kids:
                    if c not in children:
                        stack.append((c, False))
                    if c in param_acc and node not in views:
                        direct.add(id(param_acc[c]))
        # A parameter used directly anywhere is captured at its accumulator, not at its views
        # (capturing both would count the views' share twice).
        capture = {n: p for n, p in views.items() if id(p) not in direct}
        capture.update({n: p for n, p in param_acc.items() if id(p) in direct})
        reach_i: dict[Node, bool] = {}
        reach_q: dict[Node, bool] = {}
        for node in order:
            kids = children[node]
            reach_i[node] = node in input_nodes or any(reach_i[c] for c in kids)
            reach_q[node] = node in capture or any(reach_q[c] for c in kids)
        self.children, self.order, self.capture, self.reach_i = children, order, capture, reach_i
        self.direct = direct
        self.q = {n for n in order if reach_q[n] and not reach_i[n]}
        self.frontier = [n for n in order if reach_i[n] and any(c in self.q for c in children[n])]

    def in_i(self, node: Node) -> bool:
        return self.reach_i.get(node, False)

    def bottom(self) -> list[Node]:
        """The nodes of I below which nothing is in I."""
        return [n for n in self.order if self.reach_i[n] and not any(self.reach_i[c] for c in self.children[n])]

    def _q_part(self, entries: Iterable[Node]) -> set[Node]:
        """Q nodes reachable from ``entries`` (Q nodes), not looking below capture points."""
        seen: set[Node] = set()
        stack = list(entries)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                if n not in self.capture:
                    stack.extend(c for c in self.children[n] if c in self.q)
        return seen

    def weight_nodes(self, groups: list[_WeightGroup]) -> set[Node]:
        """Every node W runs: the frontier, all of Q, and the input-gradient path between
        frontier nodes that W re-runs together."""
        nodes = set(self.frontier) | self.q
        for g in groups:
            if len(g.pinned) > 1:
                nodes |= self._between({n for n, _ in g.pinned})
        return nodes

    def _between(self, pinned: set[Node]) -> set[Node]:
        """I nodes on a path from one pinned node down to another."""
        leads: dict[Node, bool] = {}
        for n in self.order:
            leads[n] = self.reach_i[n] and (n in pinned or any(leads[c] for c in self.children[n]))
        below: set[Node] = set()
        stack = [c for n in pinned for c in self.children[n] if leads[c]]
        while stack:
            n = stack.pop()
            if n not in below:
                below.add(n)
                stack.extend(c for c in self.children[n] if leads[c])
        return below

    def weight_groups(self, root_edges: list[GradientEdge], grads: list, saved_grads: dict[Node, tuple]) -> list[_WeightGroup]:
        # Units of W work: each frontier node, plus the outputs whose graph is all Q (first stage).
        units: list[tuple[list[GradientEdge], list[torch.Tensor], Node | None, set[Node]]] = []
        q_roots = [(e, g) for e, g in zip(root_edges, grads) if e.node in self.q]
        if q_roots:
            units.append(([e for e, _ in q_roots], [g for _, g in q_roots], None, self._q_part(e.node for e, _ in q_roots)))
        for n in self.frontier:
            sg = saved_grads.get(n)
            if sg is None:  # no gradient reached it in B: nothing for W to do there
                continue
            slots = [i for i, g in enumerate(sg) if g is not None]
            units.append(
                (
                    [GradientEdge(n, i) for i in slots],
                    [sg[i] for i in slots],
                    n,
                    self._q_part(c for c in self.children[n] if c in self.q),
                )
            )
        # Units whose Q parts meet must run as one autograd call (union-find over shared Q nodes).
        parent = list(range(len(units)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[Node, int] = {}
        for i, (_, _, _, part) in enumerate(units):
            for q in part:
                j = owner.setdefault(q, i)
                if j != i:
                    parent[find(i)] = find(j)
        groups: dict[int, _WeightGroup] = {}
        for i, (roots, gs, node, part) in enumerate(units):
            g = groups.setdefault(find(i), _WeightGroup([], [], [], {}))
            g.roots += roots
            g.grads += gs
            if node is not None:
                g.pinned.append((node, saved_grads[node]))
            g.captures.update((q, self.capture[q]) for q in part if q in self.capture)
        return [g for g in groups.values() if g.captures]
