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
import math
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


# The order in which autograd sums a parameter's gradients. ``loss.backward()`` runs the nodes
# of a graph built in one thread in decreasing sequence number, so a parameter's uses reach it
# in reverse call order (within one call, in argument order), and it sums them in that order:
# ((g_last + g_before) + ...). With three uses or more another order rounds differently, so
# every gradient W adds up carries a key (call, argument), summed in that order: calls from the
# last, a call's arguments from the first. ``_PREFIX``: a sum autograd made itself (of uses that
# all reach the parameter before the others).
_PREFIX = (math.inf, 0)


def _autograd_order(part: tuple) -> tuple:
    call, argument = part[0]
    return -call, argument


@dataclass
class _ParamUses:
    """Where a forward used one parameter (call numbers): in a Linear the split may defer, or
    otherwise."""

    deferred: list[int] = field(default_factory=list)
    other: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Verdict:
    """How the split passes of one module and input signature run, from its first microbatch."""

    kind: str  # _FAST, _GENERIC or _WHOLE
    no_defer: frozenset[int] = frozenset()  # parameters whose Linears are not deferred


class _Record:
    """One deferred ``F.linear``: what B and W need of it.

    ``x`` holds the input as ``F.linear``'s matrix product reads it (a 2-D view of it, or the
    contiguous copy that product makes of an input no view can fold), so that B and W compute
    the gradients autograd would from the same tensors, and the meter counts what autograd
    would have saved. ``fused``: ``F.linear`` adds the bias inside its product (``addmm``; else
    the product, then an add whose bias gradient sums over every leading dimension)."""

    __slots__ = ("weight", "bias", "x", "grad", "fused", "version", "node", "deferral", "key")

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, fused: bool, deferral: _Deferral, key: tuple) -> None:
        self.weight, self.bias, self.fused, self.deferral, self.key = weight, bias, fused, deferral, key
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


def _deferrable(func, args: tuple, kwargs: dict, params: dict[int, nn.Parameter]) -> tuple | None:
    """``(x, weight, bias)`` of an ``F.linear`` call the split may defer: on the stage's own
    parameters, a plain input, and not under autocast (its casts would have to be replayed in
    W); else None."""
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
    if type(x) is not torch.Tensor or x.dim() == 0 or torch.is_autocast_enabled(x.device.type):
        return None
    return x, w, b


def _ours(pack: Callable) -> bool:
    """Whether the saved-tensor hooks in force are the split's (``pack`` theirs). Inside others
    (``torch.utils.checkpoint``'s, ``save_on_cpu``) calls are not deferred: those hooks (a
    checkpoint's recomputation, in backward) expect what the unsplit call saves."""
    top = _top_saved_tensors_hooks(False)
    return top is not None and top[0] == pack


class _Deferral:
    """The deferred weight uses of one forward (``F.linear`` on a stage parameter)."""

    def __init__(self, params: dict[int, nn.Parameter], saved: SavedActivations, no_defer: frozenset[int]) -> None:
        self._params = params
        self._no_defer = no_defer
        self.saved = saved
        self.pack = saved.pack_hook
        self.anchor = torch.empty(0, requires_grad=True)
        self.records: list[_Record] = []
        self.now = False  # set by a backward that runs the pass whole: weight gradients to autograd

    def call(self, func, args: tuple, kwargs: dict, key: tuple | None = None):
        """The output of ``func`` run deferred, or None when it is not a use this path takes.
        ``key``: its place in the order of uses (default: after the records before it)."""
        a = _deferrable(func, args, kwargs, self._params)
        if a is None or not _ours(self.pack):
            return None
        return self.defer(a, (len(self.records), 0) if key is None else key)

    def may_defer(self, a: tuple) -> bool:
        """Whether this signature defers a Linear on these parameters (``_Verdict.no_defer``)."""
        return id(a[1]) not in self._no_defer and (a[2] is None or id(a[2]) not in self._no_defer)

    def defer(self, a: tuple, key: tuple) -> torch.Tensor | None:
        x, w, b = a
        if not self.may_defer(a):
            return None
        # as at::linear: the bias inside the product for a matrix or a contiguous input
        rec = _Record(w, b, b is not None and (x.dim() == 2 or x.is_contiguous()), self, key)
        out = _LinearInputGrad.apply(x, w, b, self.anchor, rec, self.saved)
        rec.node = out.grad_fn
        self.records.append(rec)
        if out.dim() != x.dim():  # the product of a folded input: unfolded here, outside the Function
            out = out.view(*x.shape[:-1], w.shape[0])
        return out

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
                    uses.add(r.weight, None, r.key)
                    if r.bias is not None:
                        uses.add(r.bias, None, r.key)
                    continue
                x = self.saved.read(r.x)
                g2 = g if g.dim() == 2 else g.reshape(-1, g.shape[-1])
                uses.add(r.weight, _weight_grad(r.weight, g2, x), r.key, fresh=True)
                if r.bias is not None:
                    uses.add(r.bias, _bias_grad(g, g2, r.fused), r.key, fresh=True)
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
    numbering the uses (``keys``: view node -> (call, argument)), and follow the inputs' data
    flow when ``data`` is given.

    With a ``deferral``, Linears are deferred (outside other saved-tensor hooks, and unless
    the signature's verdict says not to). Without one (``record``: the first microbatch of a
    signature) nothing is deferred; the uses are recorded, those a deferral would take apart,
    for the verdict. Views are made from the last argument to the first, so that autograd
    (which runs later nodes first) sums a call's uses in argument order, as unsplit."""

    def __init__(
        self, params: dict[int, nn.Parameter], views: dict[Node, nn.Parameter], keys: dict[Node, tuple],
        data: _DataFlow | None, deferral: _Deferral | None, pack: Callable, record: bool,
    ) -> None:
        super().__init__()
        self._params = params
        self._views = views
        self._keys = keys
        self._data = data
        self._deferral = deferral
        self._pack = pack
        self.uses: dict[int, _ParamUses] | None = {} if record else None
        self.heavy = False  # a parameter used by an op outside _CHEAP (and not a Linear the split defers)
        self.opaque = False  # calls ran inside other saved-tensor hooks (see ``_ours``)
        self._calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():  # grad-free code needs no split
            return func(*args, **kwargs)
        self._calls += 1
        call = self._calls
        lin = None
        if _ours(self._pack):
            lin = _deferrable(func, args, kwargs, self._params)
        else:
            self.opaque = True
        if lin is not None and self._deferral is not None:
            out = self._deferral.defer(lin, (call, 0))
            if out is not None:
                if self._data is not None:
                    self._data.note(args, kwargs, out)
                return out
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: p.shape is no use of p, p.T is
            out = func(*args)
            if isinstance(out, torch.Tensor) and id(args[0]) in self._params:
                args, kwargs = self._swap(args, {}, call, name, lin)
                out = func(*args)
        else:
            args, kwargs = self._swap(args, kwargs, call, name, lin)
            out = func(*args, **kwargs)
        if self._data is not None:
            self._data.note(args, kwargs, out)
        return out

    def _swap(self, args: tuple, kwargs: dict, call: int, name: str, lin: tuple | None) -> tuple[tuple, dict]:
        found: list[nn.Parameter] = []
        kept = False  # a parameter passed as it is, under autocast

        def collect(a) -> None:
            nonlocal kept
            if isinstance(a, nn.Parameter):
                if self._params.get(id(a)) is a:
                    if torch.is_autocast_enabled(a.device.type):
                        # autocast casts a parameter once and reuses the cast for all its uses
                        # there, whose gradients autograd then sums before the cast back: a view
                        # per use would give each its own cast
                        kept = True
                        if self.uses is not None:
                            self.uses.setdefault(id(a), _ParamUses()).other.append(call)
                    else:
                        found.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    collect(x)

        for a in (*args, *kwargs.values()):
            collect(a)
        if kept and name not in _CHEAP:
            self.heavy = True
        if not found:
            return args, kwargs
        views: list[torch.Tensor] = [found[0]] * len(found)
        for i in reversed(range(len(found))):  # the first argument's view last (see the class docstring)
            p = found[i]
            v = p.view_as(p)
            assert v.grad_fn is not None  # a view of a leaf that requires grad has one
            self._views[v.grad_fn] = p
            self._keys[v.grad_fn] = (call, i)
            views[i] = v
            linear_use = lin is not None and (p is lin[1] or p is lin[2])
            if self.uses is not None:
                u = self.uses.setdefault(id(p), _ParamUses())
                (u.deferred if linear_use else u.other).append(call)
            if not linear_use and name not in _CHEAP:
                self.heavy = True
        it = iter(views)

        def replace(a):
            if isinstance(a, nn.Parameter):
                mine = self._params.get(id(a)) is a and not torch.is_autocast_enabled(a.device.type)
                return next(it) if mine else a
            if isinstance(a, (list, tuple)) and any(isinstance(x, nn.Parameter) for x in a):
                return type(a)(replace(x) for x in a)
            return a

        new_args = tuple(replace(a) for a in args)
        return new_args, {k: replace(v) for k, v in kwargs.items()}


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
    views: dict[Node, nn.Parameter] = field(default_factory=dict)  # per-use views -> their parameter
    keys: dict[Node, tuple] = field(default_factory=dict)  # per-use views -> their place in the order of uses
    data: _DataFlow | None = None  # a first stage's data flow (its inputs need no gradient)
    deferral: _Deferral | None = None  # the deferred Linear uses (split only)
    fast: bool = False  # the lean forward of a checked signature: B takes the fast path
    opaque: bool = False  # calls ran inside other saved-tensor hooks: B takes every parameter use
    heavy: bool = False  # a parameter used by an op that is neither deferred nor cheap
    # a first stage: B keeps the output gradients, W runs the whole backward (B's and W's
    # parts of the split if ``views`` or ``deferral``)
    whole_in_w: bool = False
    whole_in_b: bool = False  # B runs the whole backward (a reentrant checkpoint), W nothing
    uses: dict[int, _ParamUses] | None = None  # a signature's first microbatch: its uses, for the verdict
    verdict: Callable[[_Verdict], None] | None = None  # records the verdict when this pass is its signature's first
    # set by backward_input, consumed by backward_weight:
    groups: list[_WeightGroup] = field(default_factory=list)
    pending: tuple[Sequence, Sequence] = ((), ())  # whole_in_w: the outputs and their gradients
    early: list[tuple[nn.Parameter, torch.Tensor, tuple]] = field(default_factory=list)  # from B, for W: (param, grad, key)


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

    A split pass refuses a forward that changes one of the stage's parameters in place (a
    weight clamp, ``nn.Embedding(max_norm=...)``): its backward runs after other microbatches'
    forwards, which would have changed what it needs.
    """
    every = list(module.parameters())
    versions = [p._version for p in every] if split else None
    fp = _forward(module, inputs, [p for p in every if p.requires_grad], split, post, meter, deferred_first)
    if versions is not None:
        changed = [p for p, v in zip(every, versions) if p._version != v]
        if changed:
            fp.saved.free()
            names = [n for n, p in module.named_parameters() if any(p is q for q in changed)]
            raise PipelineError(
                f"the stage's forward changed parameter {', '.join(repr(n) for n in names)} in place (a weight clamp, "
                "nn.Embedding(max_norm=...)): a split backward runs after other microbatches' forwards, which change "
                "what it needs; change it outside the forward (after the optimizer step)"
            )
    return fp


def _forward(
    module: nn.Module, inputs: Sequence, params: list[nn.Parameter], split: bool, post: Callable | None,
    meter: ActivationMeter | None, deferred_first: bool,
) -> ForwardPass:
    saved = SavedActivations(meter, module)
    first = _first(inputs)
    in_w = split and backward_in_w(module, inputs)
    sig = _signature(inputs, post)
    see_signature(module, (sig, torch.is_grad_enabled(), torch.is_autocast_enabled(), module.training))
    known = _CHECKED.setdefault(module, {})
    verdict = known.get(sig) if split else None
    whole = in_w and (not deferred_first or (verdict is not None and verdict.kind == _WHOLE))  # one plain backward in W
    in_b = split and not in_w and verdict is not None and verdict.kind == _WHOLE  # one plain backward in B
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
        return ForwardPass(tuple(inputs), outs, params, saved, whole_in_w=whole, whole_in_b=in_b)
    mine = {id(p): p for p in params}
    if verdict is not None and (verdict.kind == _FAST or in_w):
        # the fast path, with a lean forward: where checked, or where B's part runs in W anyway
        lean = _Deferral(mine, saved, verdict.no_defer)
        with saved.hooks(), _DeferOnly(lean):
            out = module(*inputs)
            if post is not None:
                out = post(out)
        return ForwardPass(tuple(inputs), _as_tensors(out), params, saved, deferral=lean, fast=True, whole_in_w=in_w)
    # the first microbatch of a signature (nothing deferred, every use recorded), or the generic split
    views: dict[Node, nn.Parameter] = {}
    keys: dict[Node, tuple] = {}
    data = _DataFlow(inputs) if first and not in_w else None
    deferral = None if verdict is None else _Deferral(mine, saved, verdict.no_defer)
    mode = _ViewPerUse(mine, views, keys, data, deferral, saved.pack_hook, record=verdict is None)
    with saved.hooks(), mode:
        out = module(*inputs)
        if post is not None:
            out = post(out)
    outs = _as_tensors(out)
    if data is not None:
        for t in outs:
            data.seen(t)  # an output's own place, in case no later call used it
    return ForwardPass(
        tuple(inputs), outs, params, saved, views, keys, data, deferral, opaque=mode.opaque, heavy=mode.heavy,
        whole_in_w=in_w, uses=mode.uses, verdict=None if verdict is not None else functools.partial(known.__setitem__, sig),
    )


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
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Verdict]] = weakref.WeakKeyDictionary()


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
    idx = _grad_inputs(fp)
    if fp.fast:
        return _fast_backward_input(fp, outs, grads, idx)
    if fp.data is None:  # I: what reaches the inputs
        input_nodes = {get_gradient_edge(fp.inputs[i]).node for i in idx}
    else:  # I: what depends on the inputs
        input_nodes = {n for n, _ in fp.data.edges}
    root_edges = [get_gradient_edge(o) for o in outs]
    graph = _Graph([e.node for e in root_edges], input_nodes, fp)
    if fp.verdict is not None:  # the first microbatch of its signature: how the next ones run
        fp.verdict(_decide(fp, graph))
        fp.verdict = None
    if graph.reentrant:
        return _whole_in_b(fp, outs, grads, idx)
    if fp.opaque or fp.whole_in_w:
        return _per_use_input(fp, outs, grads, idx, graph.direct)
    return _cut_input(fp, outs, grads, idx, graph, root_edges)


def _decide(fp: ForwardPass, graph: _Graph) -> _Verdict:
    """The verdict on a signature from its first microbatch: the whole backward in B if a
    reentrant checkpoint is in the graph; else the fast path unless a parameter is used by an
    op that is neither a Linear nor cheap, or inside a custom autograd Function (outside other
    saved-tensor hooks, where such uses are B's anyway); and the Linears of a parameter not
    deferred where the fast path could not sum its uses in autograd's order: with three uses or
    more, the fast path adds the deferred ones after a sum autograd made of the others, which
    is that order only if every deferred use came before every other one (used inside a custom
    autograd Function, a parameter's place in that order is unknown)."""
    if graph.reentrant:
        return _Verdict(_WHOLE)
    no_defer = set()
    for pid, u in (fp.uses or {}).items():
        direct = pid in graph.direct
        n = len(u.deferred) + len(u.other) + direct
        if n >= 3 and u.deferred and (direct or (u.other and max(u.deferred) > min(u.other))):
            no_defer.add(pid)
    generic = (fp.heavy or graph.direct) and not fp.opaque
    return _Verdict(_GENERIC if generic else _FAST, frozenset(no_defer))


def _cut_input(fp: ForwardPass, outs: list, grads: list, idx: list[int], graph: _Graph, root_edges: list) -> list:
    """B of the generic split: the graph cut in two (module docstring)."""
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
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
        known = all([_touch_saved(node) for node in graph.weight_nodes(fp.groups)])
    if fp.deferral is not None:
        keep |= fp.deferral.holders()
    if known:  # else W re-runs a node whose saved tensors cannot be read apart: keep them all
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


def _per_use_input(fp: ForwardPass, outs: list, grads: list, idx: list[int], direct: set[int]) -> list[torch.Tensor | None]:
    """B taking every parameter use at once, in one autograd call that frees the graph as it
    goes: the input gradients, each per-use view's gradient (a parameter also used without a
    view: its accumulator's, the sum autograd makes of all its uses), for W to add up in
    autograd's order. For passes whose graph W could not re-run: calls inside other
    saved-tensor hooks (a checkpoint would recompute its region again, once per saved tensor
    read outside a backward), and a first stage's first microbatch, all of whose backward is
    W's anyway."""
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    captures: list[tuple[GradientEdge, nn.Parameter, tuple]] = [
        (GradientEdge(n, 0), p, fp.keys[n]) for n, p in fp.views.items() if id(p) not in direct
    ]
    captures += [(get_gradient_edge(p), p, _PREFIX) for p in fp.params if id(p) in direct]
    anchor = [fp.deferral.anchor] if fp.deferral is not None and fp.deferral.records else []
    targets = [fp.inputs[i] for i in idx] + anchor + [e for e, _, _ in captures]
    if outs and targets:
        with fp.saved.consuming(), _TensorHooksPaused(fp.params):
            got = engine.grad(outs, targets, grads)
        for i, g in zip(idx, got):
            result[i] = g
        start = len(idx) + len(anchor)
        fp.early = [(p, g, key) for (_, p, key), g in zip(captures, got[start:]) if g is not None]
    fp.saved.keep_only(fp.deferral.holders() if fp.deferral is not None else set())
    fp.views = {}
    fp.outputs = ()
    fp.inputs = ()
    return result


def _fast_backward_input(fp: ForwardPass, outs: list, grads: list, idx: list[int]) -> list[torch.Tensor | None]:
    """B on the fast path: one autograd call, freeing the graph as it goes, for the input
    gradients, every deferred layer's output gradient and the gradients of the other parameter
    uses (the cheap ones, and any the check did not see: exact, in B rather than W). Those are
    added to ``.grad`` in W, as on the generic path, so that gradients accumulate over
    microbatches in the same order whichever path each took (bit for bit ``loss.backward()``)."""
    assert fp.deferral is not None
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    # Every parameter is asked for: those only deferred get nothing from their Linears (the
    # Function leaves their gradient to W) and cost nothing.
    targets = [fp.inputs[i] for i in idx] + [fp.deferral.anchor] + fp.params
    if outs:
        with fp.saved.consuming(), _TensorHooksPaused(fp.params):
            got = engine.grad(outs, targets, grads)
        for i, g in zip(idx, got):
            result[i] = g
        fp.early = [(p, g, _PREFIX) for p, g in zip(fp.params, got[len(idx) + 1:]) if g is not None]
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
        if fp.deferral is None and not fp.views:  # one plain backward: no deferred, early or grouped gradients
            _backward_accumulating(fp, outs, grads, [])
            _release(fp)
            return
        _split_input(fp, list(outs), list(grads))  # B's part first, then W's as on any split pass
        if fp.whole_in_b:
            _release(fp)
            return
    records = fp.deferral.records if fp.deferral is not None else []
    uses = _Uses(
        [q for r in records for q in (r.weight, r.bias) if q is not None]
        + [p for p, _, _ in fp.early] + [p for g in fp.groups for p in g.captures.values()]
    )
    if fp.deferral is not None:
        fp.deferral.weight_grads(uses)
    for p, g, key in fp.early:
        uses.add(p, g, key)
    for group in fp.groups:
        handles = [n.register_prehook(_pin(g)) for n, g in group.pinned] if len(group.pinned) > 1 else []
        try:
            with _TensorHooksPaused(group.captures.values()):
                got = engine.grad(group.roots, [GradientEdge(n, 0) for n in group.captures], group.grads, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        for (node, p), pg in zip(group.captures.items(), got):
            uses.add(p, pg, fp.keys.get(node, _PREFIX))
    uses.finish()
    _release(fp)


class _Uses:
    """Adds each parameter's gradients into its ``.grad`` as autograd does: the gradients of a
    parameter's uses summed first, in autograd's order (their keys), then one add
    (``.grad + (g1 + g2)``, not ``(.grad + g1) + g2``, which rounds differently once ``.grad``
    holds earlier microbatches). A parameter is added as soon as its last use is in, so no
    gradient waits in memory longer than that.

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
        self._parts: dict[int, list[tuple[tuple, torch.Tensor, bool]]] = {}
        self._hooked: list[tuple[nn.Parameter, torch.Tensor]] = []

    def add(self, p: nn.Parameter, g: torch.Tensor | None, key: tuple, fresh: bool = False) -> None:
        """One use's gradient (None: no gradient reached it) at ``key`` in the order of uses;
        ``fresh``: a new tensor nothing else holds."""
        k = id(p)
        self._left[k] -= 1
        if g is not None:
            self._parts.setdefault(k, []).append((key, g, fresh))
        if self._left[k]:
            return
        parts = self._parts.pop(k, None)
        if not parts:
            return
        if len(parts) == 1:
            _, total, fresh = parts[0]
        else:
            parts.sort(key=_autograd_order)
            total = parts[0][1]
            with torch.no_grad():
                for _, part, _ in parts[1:]:
                    total = total + part
            fresh = True
        if _has_hooks(p):
            self._hooked.append((p, total))
        else:
            _accumulate(p, total, fresh)

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
    fp.keys = {}
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


def _touch_saved(node: Node) -> bool:
    """Read the tensors ``node`` saved (so that ``SavedActivations.record`` sees them); False
    where they cannot be reached: an in-place change of a view (``CopySlices``) keeps its
    operation's node, and what it saved, out of sight."""
    if node.name() == _COPY_SLICES:
        return False
    for name in _saved_names(type(node)):
        getattr(node, name)
    getattr(node, "saved_tensors", None)  # a custom autograd.Function's context
    return True


_COPY_SLICES = "torch::autograd::CopySlices"


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
