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
* The first stage's inputs need no gradient (token ids, data), so there is no input to reach.
  There I is the part of the graph that depends on the inputs, found by following them through
  forward (the same ``TorchFunctionMode``): B runs it down to its lowest nodes and keeps the
  gradient arriving there, without computing any gradient for the inputs themselves. So the
  first stage's B does the activation-gradient work the cost model gives it and frees what it
  frees on the other stages, and W the rest.
* B frees the activations W does not read (see ``memory``), so memory follows the model:
  F allocates M_B, B frees M_B - M_W, W frees M_W.

``backward_full`` is the fused BW: one ordinary backward, no analysis. Gradients accumulate
into ``param.grad`` like ``loss.backward()``. These functions are the ones the profiler times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .errors import PipelineError
from .memory import ActivationMeter, SavedActivations

__all__ = ["ForwardPass", "forward_pass", "backward_input", "backward_weight", "backward_full"]


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


class _ViewPerUse(TorchFunctionMode):
    """Replace each stage parameter by a fresh identity view in every torch call that uses it,
    and follow the inputs' data flow when ``data`` is given."""

    def __init__(self, params: dict[int, nn.Parameter], views: dict[Node, nn.Parameter], data: _DataFlow | None) -> None:
        super().__init__()
        self._params = params
        self._views = views
        self._data = data

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():  # grad-free code needs no split
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":  # a property: p.shape is no use of p, p.T is
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
                self._views[v.grad_fn] = p
                return v
            return a
        if isinstance(a, (list, tuple)) and any(isinstance(x, nn.Parameter) for x in a):
            return type(a)(self._swap(x) for x in a)
        return a


@dataclass(eq=False)
class ForwardPass:
    """One stage forward on one microbatch, and what its backward passes need."""

    inputs: tuple
    outputs: tuple[torch.Tensor, ...]
    params: list[nn.Parameter]
    saved: SavedActivations
    views: dict[Node, nn.Parameter]
    data: _DataFlow | None  # a first stage's data flow (its inputs need no gradient)
    # set by backward_input, consumed by backward_weight:
    groups: list["_WeightGroup"] = field(default_factory=list)


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
) -> ForwardPass:
    """Run ``module(*inputs)`` (then ``post`` on its output, e.g. a loss) for a later backward.

    ``split=False`` is for a fused backward (BW): no per-use views, nothing to split.
    Outputs are returned as a tuple of tensors (``ForwardPass.outputs``).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    saved = SavedActivations(meter, {id(t) for t in (*module.parameters(), *module.buffers())})
    views: dict[Node, nn.Parameter] = {}
    first = not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    data = _DataFlow(inputs) if split and first else None
    with saved.hooks(), _ViewPerUse({id(p): p for p in params}, views, data) if split else contextlib.nullcontext():
        out = module(*inputs)
        if post is not None:
            out = post(out)
    outs = _as_tensors(out)
    if data is not None:
        for t in outs:
            data.seen(t)  # an output's own place, in case no later call used it
    return ForwardPass(tuple(inputs), outs, params, saved, views, data)


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
    idx = _grad_inputs(fp)
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    if outs:
        wanted = [fp.inputs[i] for i in idx] + fp.params
        got = torch.autograd.grad(outs, wanted, grads, allow_unused=True)
        for i, g in zip(idx, got):
            result[i] = g
        for p, g in zip(fp.params, got[len(idx):]):
            _accumulate(p, g)
    _release(fp)
    return result


def backward_input(fp: ForwardPass, output_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """B: the gradient of each stage input (None where an input needs none)."""
    outs, grads = _roots(fp, output_grads)
    idx = _grad_inputs(fp)
    result: list[torch.Tensor | None] = [None] * len(fp.inputs)
    if fp.data is None:  # I: what reaches the inputs
        input_nodes = {get_gradient_edge(fp.inputs[i]).node for i in idx}
    else:  # I: what depends on the inputs
        input_nodes = {n for n, _ in fp.data.edges}
    root_edges = [get_gradient_edge(o) for o in outs]
    graph = _Graph([e.node for e in root_edges], input_nodes, fp)
    # B stops at the inputs, or for a first stage at the lowest nodes of I, whose work is all W's
    if fp.data is None:
        targets = [fp.inputs[i] for i in idx]
    else:
        bottom = set(graph.bottom())
        targets = [GradientEdge(n, k) for n, k in fp.data.edges if n in bottom]
    saved_grads: dict[Node, tuple] = {}
    handles = [n.register_prehook(_saver(saved_grads, n)) for n in graph.frontier]
    try:
        b_roots = [(o, g) for o, e, g in zip(outs, root_edges, grads) if graph.in_i(e.node)]
        if b_roots and targets:
            got = torch.autograd.grad(
                [o for o, _ in b_roots], targets, [g for _, g in b_roots], retain_graph=True, allow_unused=True
            )
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
    fp.saved.keep_only(keep)
    fp.outputs = ()
    fp.inputs = ()
    return result


def backward_weight(fp: ForwardPass) -> None:
    """W: accumulate the parameter gradients left by ``backward_input``."""
    for group in fp.groups:
        handles = [n.register_prehook(_pin(g)) for n, g in group.pinned] if len(group.pinned) > 1 else []
        try:
            got = torch.autograd.grad(
                group.roots, [GradientEdge(n, 0) for n in group.captures], group.grads, retain_graph=True, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        for p, g in zip(group.captures.values(), got):
            _accumulate(p, g)
    _release(fp)


def _release(fp: ForwardPass) -> None:
    fp.saved.free()
    fp.groups = []
    fp.views = {}
    fp.data = None
    fp.outputs = ()
    fp.inputs = ()


def _accumulate(p: nn.Parameter, g: torch.Tensor | None) -> None:
    if g is None:
        return
    if p.grad is None:
        # a fresh tensor: g may alias a gradient still in use elsewhere
        p.grad = g.detach().clone(memory_format=torch.contiguous_format)
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
        param_acc: dict[Node, nn.Parameter] = {v.next_functions[0][0]: p for v, p in views.items()}
        viewed = {id(p) for p in views.values()}
        param_acc.update({get_gradient_edge(p).node: p for p in fp.params if id(p) not in viewed})
        children: dict[Node, list[Node]] = {}
        order: list[Node] = []  # children before parents
        direct: set[int] = set()  # parameters some node uses without a per-use view
        stack = [(r, False) for r in roots]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
            elif node not in children:
                kids = children[node] = [c for c, _ in node.next_functions if c is not None]
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
            units.append(([GradientEdge(n, i) for i in slots], [sg[i] for i in slots], n, self._q_part(c for c in self.children[n] if c in self.q)))
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
