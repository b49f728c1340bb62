"""The passes: F (``forward_pass``), B (``backward_input``), W (``backward_weight``), and the
fused BW (``backward_full``), as the runtime runs them and the profiler times them.

B returns the input gradients and a ``WeightPass``: everything W needs, handed over
explicitly (W takes nothing else). Gradients accumulate into ``param.grad`` as
``loss.backward()`` would, microbatch after microbatch, bit for bit (``accumulation``).

How a split pass runs is decided per module and input signature on its first microbatch,
which runs the generic split (``graph_cut``) with every parameter use numbered and nothing
deferred, and records a verdict for the next ones:

* ``fast``: every parameter use is a Linear the split defers, or cheap (elementwise, a norm),
  or inside other saved-tensor hooks: later forwards run lean and B takes the fast path
  (``deferred``). The Linears of a parameter used three times or more whose deferred uses do
  not all come before its other ones stay undeferred, so that the fast B's sum of a parameter's
  other uses is a prefix of autograd's order.
* ``generic``: a parameter is used otherwise (a plain matrix product, a custom autograd
  Function): every forward runs the generic split, with its Linears deferred.
* ``whole``: the graph holds a reentrant ``torch.utils.checkpoint``, which refuses
  ``autograd.grad``: B runs the whole backward in one plain autograd call, W nothing.

Correctness does not rest on the verdict: the fast B asks autograd for every parameter's
gradient, so a use the first microbatch did not show still gets its gradient (in B, where it
costs time, not accuracy; the last bit may differ from autograd's sum if such a parameter is
used three times or more).

A first stage (no input needs a gradient: token ids, data) is not split. Its B has no gradient
to send, so nothing waits for it: B hands the output gradients to W, which runs the whole
backward, as one plain backward or (``deferred_first``, chosen by the profiler from
measurement) as the split's B and W back to back. A module whose ``split_first_stage`` is true
is split anyway (``graph_cut``).

A split pass refuses a forward that changes one of the stage's parameters in place (a weight
clamp, ``nn.Embedding(max_norm=...)``): its backward runs after other microbatches' forwards,
which would have changed what it needs.

``backward_full`` is the fused BW: one ordinary backward, no analysis. The forward before it
(``forward_pass(split=False)``) runs the module as it is; while it runs, ``fused_forward()`` is
true, so that an emulated stage can cost it as the profile's t_ff.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import Node, get_gradient_edge

from .. import engine
from ..errors import PipelineError
from ..footprint import forward_counted, see_signature
from ..memory import ActivationMeter, SavedActivations
from ..selective import Selection
from .accumulation import Uses
from .deferred import DeferOnly, Deferral, fast_input
from .graph_cut import (
    DataFlow,
    Graph,
    ParamUses,
    ViewPerUse,
    WeightGroup,
    cut_input,
    per_use_input,
    pieces,
    run_groups,
    tensors_in,
)

__all__ = [
    "ForwardPass", "WeightPass", "forward_pass", "backward_input", "backward_weight", "backward_full", "backward_in_w",
    "fused_forward", "compiled",
]

_FUSED_FORWARD = contextvars.ContextVar("zbsearch_fused_forward", default=False)


def fused_forward() -> bool:
    """Whether the forward running now is ``forward_pass(split=False)``'s: a microbatch whose
    backward will be one fused BW, run with none of the split's deferral."""
    return _FUSED_FORWARD.get()


_FAST, _GENERIC, _WHOLE = "fast", "generic", "whole"


@dataclass(frozen=True)
class _Verdict:
    """How the split passes of one module and input signature run, from its first microbatch."""

    kind: str  # _FAST, _GENERIC or _WHOLE
    no_defer: frozenset[int] = frozenset()  # parameters whose Linears are not deferred


# module -> {input signature: verdict}
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Verdict]] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class ForwardPass:
    """One stage forward on one microbatch, for its backward (consumed by it)."""

    inputs: tuple
    outputs: tuple[torch.Tensor, ...]
    params: list[nn.Parameter]
    saved: SavedActivations
    views: dict[Node, nn.Parameter] = field(default_factory=dict)  # per-use views -> their parameter
    keys: dict[Node, tuple] = field(default_factory=dict)  # per-use views -> their place in the order of uses
    data: DataFlow | None = None  # a split first stage's data flow (its inputs need no gradient)
    deferral: Deferral | None = None  # the deferred Linears
    fast: bool = False  # the lean forward of a checked signature: B takes the fast path
    opaque: bool = False  # calls ran inside other saved-tensor hooks: B takes every parameter use
    heavy: bool = False  # a parameter used by an op that is neither a deferred Linear nor cheap
    whole_in_w: bool = False  # a first stage: W runs the whole backward
    whole_in_b: bool = False  # B runs the whole backward (a reentrant checkpoint), W nothing
    uses: dict[int, ParamUses] | None = None  # a signature's first microbatch: its uses, for the verdict
    verdict: Callable[[_Verdict], None] | None = None  # records the verdict (a signature's first microbatch)
    spent: bool = False  # its backward has run


@dataclass(eq=False)
class WeightPass:
    """W's work on one microbatch, from ``backward_input`` to ``backward_weight``: the
    activations it reads, the deferred Linears (with their output gradients), gradient pieces
    B computed, graph parts to re-run, the order of uses; or a first stage's pass, outputs and
    output gradients, whose whole backward is W's."""

    saved: SavedActivations | None = None
    deferral: Deferral | None = None
    early: list[tuple[nn.Parameter, torch.Tensor, tuple]] = field(default_factory=list)  # (param, grad, key)
    groups: list[WeightGroup] = field(default_factory=list)
    keys: dict[Node, tuple] = field(default_factory=dict)
    whole: tuple[ForwardPass, list, list] | None = None
    empty: bool = False  # B ran the whole backward
    ran: bool = False


def forward_pass(
    module: nn.Module,
    inputs: Sequence,
    *,
    split: bool = True,
    post: Callable | None = None,
    meter: ActivationMeter | None = None,
    deferred_first: bool = False,
    select: Selection | None = None,
) -> ForwardPass:
    """F: run ``module(*inputs)`` (then ``post`` on its output, e.g. a loss) for a later backward.

    ``split=False`` is for a fused backward (BW): no per-use views, nothing to split. A first
    stage (no input needs a gradient) is not split either, unless ``module.split_first_stage``
    is true: its B has no gradient to send, so B does nothing and W runs the whole backward, as
    one plain backward or, with ``deferred_first``, as the split's B and W back to back.
    Outputs are returned as a tuple of tensors (``ForwardPass.outputs``). ``meter`` counts the
    activations saved. A split pass that changes one of the stage's parameters in place is
    refused (PipelineError naming it). ``select``: checkpointed for selective recomputation,
    the selected modules' activations left to its RS pass (``selective``).
    """
    every = list(module.parameters())
    versions = [p._version for p in every] if split else None
    fp = _forward(module, inputs, [p for p in every if p.requires_grad], split, post, meter, deferred_first, select)
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
    meter: ActivationMeter | None, deferred_first: bool, select: Selection | None = None,
) -> ForwardPass:
    saved = SavedActivations(meter, module)
    recording = contextlib.nullcontext() if select is None else select.recording(saved)
    in_w = split and backward_in_w(module, inputs)
    sig = _signature(inputs, post)
    see_signature(module, (sig, torch.is_grad_enabled(), torch.is_autocast_enabled(), module.training))
    known = _CHECKED.setdefault(module, {})
    verdict = known.get(sig) if split else None
    whole = in_w and (not deferred_first or (verdict is not None and verdict.kind == _WHOLE))  # one plain backward in W
    # one plain backward in B: a reentrant checkpoint, or a compiled stage (``compiled``)
    in_b = split and not in_w and ((verdict is not None and verdict.kind == _WHOLE) or compiled(module))
    if not split or whole or in_b:

        def run() -> tuple[torch.Tensor, ...]:
            token = _FUSED_FORWARD.set(not split)
            try:
                out = module(*inputs)
                return _as_tensors(out if post is None else post(out))
            finally:
                _FUSED_FORWARD.reset(token)

        if select is not None:  # the hooks must see every save: they divert the selected modules'
            with saved.hooks(), recording:
                outs = run()
            select.mode = contextlib.nullcontext
        elif meter is None:  # nothing to count: no hooks
            outs = run()
        elif meter.replay:
            extra = tensors_in((post.args, post.keywords)) if isinstance(post, functools.partial) else []
            outs = forward_counted(module, run, saved, inputs, extra)
        else:
            with saved.hooks():
                outs = run()
        return ForwardPass(tuple(inputs), outs, params, saved, whole_in_w=whole, whole_in_b=in_b)
    mine = {id(p): p for p in params}
    if verdict is not None and (verdict.kind == _FAST or in_w):
        # the fast path's lean forward: where checked, or where B's part runs in W anyway
        lean = Deferral(mine, saved, verdict.no_defer)
        if select is not None:  # RS runs the selected modules again as they ran here
            no_defer = verdict.no_defer
            select.mode = lambda: DeferOnly(Deferral(mine, saved, no_defer))
        with saved.hooks(), DeferOnly(lean), recording:
            out = module(*inputs)
            if post is not None:
                out = post(out)
        return ForwardPass(tuple(inputs), _as_tensors(out), params, saved, deferral=lean, fast=True, whole_in_w=in_w)
    # the first microbatch of a signature (nothing deferred, every use recorded), or the generic split
    views: dict[Node, nn.Parameter] = {}
    keys: dict[Node, tuple] = {}
    data = DataFlow(inputs) if _first(inputs) and not in_w else None
    deferral = None if verdict is None else Deferral(mine, saved, verdict.no_defer)
    mode = ViewPerUse(mine, views, keys, data, deferral, saved.pack_hook, record=verdict is None)
    if select is not None:  # RS runs the selected modules again as they ran here (views, deferral)
        again = None if verdict is None else verdict.no_defer
        select.mode = lambda: ViewPerUse(mine, {}, {}, None, None if again is None else Deferral(mine, saved, again),
                                         saved.pack_hook, record=False)
    with saved.hooks(), mode, recording:
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


_COMPILED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def compiled(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules runs through ``torch.compile`` (a compiled
    wrapper, or ``Module.compile()``) and holds trainable parameters. A compiled region's
    backward is one autograd node that yields its input and its weight gradients together, so
    no graph cut can put those weight gradients in W: the stage's split pass runs its whole
    backward in B, and W has nothing left. A compiled region without parameters (an activation,
    an attention core) yields input gradients only, and the stage splits as it would eagerly."""
    known = _COMPILED.get(module)
    if known is None:
        from torch._dynamo.eval_frame import OptimizedModule

        known = _COMPILED[module] = any(
            (isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None)
            and any(p.requires_grad for p in m.parameters())
            for m in module.modules()  # (the module itself first)
        )
    return known


def backward_in_w(module: nn.Module, inputs: Sequence) -> bool:
    """Whether a split pass of ``module`` on ``inputs`` leaves its whole backward to W: a first
    stage (no input needs a gradient) that does not ask to be split (``split_first_stage``)."""
    return _first(inputs) and not getattr(module, "split_first_stage", False)


def _first(inputs: Sequence) -> bool:
    return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


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
    if fp.spent:
        raise PipelineError("this forward pass's backward has already run (B once, then W once with what B returned)")
    if len(output_grads) != len(fp.outputs):
        raise PipelineError(f"{len(output_grads)} output gradients for {len(fp.outputs)} outputs")
    pairs = [(o, g) for o, g in zip(fp.outputs, output_grads) if g is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _grad_inputs(fp: ForwardPass) -> list[int]:
    return [i for i, t in enumerate(fp.inputs) if isinstance(t, torch.Tensor) and t.requires_grad]


def backward_full(fp: ForwardPass, output_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """BW: one backward for ``output_grads``; input gradients returned, parameter gradients
    accumulated."""
    outs, grads = _roots(fp, output_grads)
    result = _backward_accumulating(fp, outs, grads, _grad_inputs(fp))
    _spend(fp)
    return result


def _backward_accumulating(fp: ForwardPass, outs: Sequence, grads: Sequence, idx: list[int]) -> list[torch.Tensor | None]:
    """One autograd call over the whole graph, freeing it as it goes: the stage inputs'
    gradients returned, every other leaf's accumulated into its ``.grad``."""
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    if not idx:  # a first stage: no input gradient to keep apart
        if outs and fp.params:
            with fp.saved.consuming():
                engine.backward(outs, grads)
        return result
    xs = [fp.inputs[i] for i in idx]
    if outs:
        # As loss.backward() does: parameter gradients accumulate in place, without copies, and
        # the inputs' own .grad is borrowed to receive theirs. Naming the leaves (``inputs=``)
        # costs more, so only inputs that are not leaves (whose graph goes on into another
        # stage's) make us name them.
        before = [x.grad for x in xs]
        for x in xs:
            x.grad = None
        with fp.saved.consuming():
            engine.backward(outs, grads, () if all(x.is_leaf for x in xs) else xs + fp.params)
        for i, x, b in zip(idx, xs, before):
            result[i], x.grad = x.grad, b
    return result


def backward_input(
    fp: ForwardPass, output_grads: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor | None], WeightPass]:
    """B: the gradient of each stage input (None where an input needs none), and W's work,
    for ``backward_weight``."""
    outs, grads = _roots(fp, output_grads)
    if fp.whole_in_w:
        fp.spent = True
        return [None] * len(fp.inputs), WeightPass(whole=(fp, outs, grads))
    if fp.whole_in_b:
        result = _backward_accumulating(fp, outs, grads, _grad_inputs(fp))
        _spend(fp)
        return result, WeightPass(empty=True)
    return _split(fp, outs, grads)


def _split(fp: ForwardPass, outs: list, grads: list) -> tuple[list[torch.Tensor | None], WeightPass]:
    """B's work on a split pass: the input gradients, and W's work."""
    idx = _grad_inputs(fp)
    inputs = [fp.inputs[i] for i in idx]
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    w = WeightPass(fp.saved, fp.deferral, keys=fp.keys)
    if fp.fast:
        assert fp.deferral is not None  # a lean forward has one
        got, w.early = fast_input(outs, grads, inputs, fp.deferral, fp.params)
    else:
        if fp.data is None:  # I: what reaches the inputs
            input_nodes = {get_gradient_edge(x).node for x in inputs}
        else:  # I: what depends on the inputs
            input_nodes = {n for n, _ in fp.data.edges}
        graph = Graph([get_gradient_edge(o).node for o in outs], input_nodes, fp.views, fp.params)
        if fp.verdict is not None:  # the first microbatch of its signature: how the next ones run
            fp.verdict(_decide(fp, graph))
        if graph.reentrant:
            return _whole_in_b(fp, outs, grads, idx)
        if fp.opaque or fp.whole_in_w:
            got, w.early = per_use_input(outs, grads, inputs, fp.views, fp.keys, fp.params, graph.direct, fp.deferral, fp.saved)
        else:
            got, w.groups = cut_input(outs, grads, inputs, fp.data, graph, fp.deferral, fp.saved)
    for i, g in zip(idx, got):
        result[i] = g
    _spend(fp, keep=True)
    return result, w


def _decide(fp: ForwardPass, graph: Graph) -> _Verdict:
    """The verdict on a signature from its first microbatch (module docstring). A parameter
    used inside a custom autograd Function has no known place in the order of uses: with
    three uses or more, its Linears are not deferred either."""
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


def _whole_in_b(fp: ForwardPass, outs: list, grads: list, idx: list[int]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """B of a pass whose graph holds a reentrant ``torch.utils.checkpoint``: it refuses any
    autograd call that names its inputs (``autograd.grad``), so B runs the whole backward in one
    plain call, and W has nothing left. Only a signature's first microbatch, which defers
    nothing, can find one; the later ones run unsplit."""
    if fp.deferral is not None and fp.deferral.records:
        raise PipelineError(
            "this microbatch's forward holds a reentrant torch.utils.checkpoint that the first microbatch of the same "
            "input signature did not: the split cannot run it; use use_reentrant=False, or the same code path every "
            "microbatch"
        )
    result = _backward_accumulating(fp, outs, grads, idx)
    fp.whole_in_b = True
    _spend(fp)
    return result, WeightPass(empty=True)


def backward_weight(w: WeightPass) -> None:
    """W: accumulate the parameter gradients of what ``backward_input`` returned second."""
    if not isinstance(w, WeightPass):
        raise PipelineError(
            f"backward_weight takes the WeightPass backward_input returned (input_grads, w = backward_input(fp, grads)), "
            f"not a {type(w).__name__}"
        )
    if w.ran:
        raise PipelineError("this W has already run")
    w.ran = True
    if w.empty:
        return
    if w.whole is not None:
        fp, outs, grads = w.whole
        w.whole = None
        if fp.deferral is None and not fp.views:  # one plain backward
            _backward_accumulating(fp, outs, grads, [])
            fp.saved.free()
            _spend(fp)
            return
        _, rest = _split(fp, outs, grads)  # B's part first, then W's as on any split pass
        backward_weight(rest)
        return
    uses = Uses([*(w.deferral.pieces() if w.deferral is not None else ()), *(p for p, _, _ in w.early), *pieces(w.groups)])
    if w.deferral is not None:
        w.deferral.weight_grads(uses)
    _add_all(uses, w.early)
    run_groups(w.groups, w.keys, uses)
    if w.saved is not None:
        w.saved.free()
    w.saved, w.deferral, w.early, w.groups, w.keys = None, None, [], [], {}
    uses.finish()  # once W holds none of the gradients (B's pieces, the gradients its groups re-ran from)


def _add_all(uses: Uses, early: list[tuple[nn.Parameter, torch.Tensor, tuple]]) -> None:
    for p, g, key in early:
        uses.add(p, g, key)


def _spend(fp: ForwardPass, keep: bool = False) -> None:
    """After a pass's backward (B, or BW): it holds nothing more (``keep``: its activations
    live on, in W's hands)."""
    if not keep:
        fp.saved.free()
    fp.spent = True
    fp.outputs = ()
    fp.inputs = ()
    fp.views = {}
    fp.keys = {}
    fp.data = None
    fp.deferral = None
    fp.uses = None
    fp.verdict = None
