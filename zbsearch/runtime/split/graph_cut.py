"""The generic split: per-use views, and the autograd graph cut into B's part and W's.

For parameters used in arbitrary ways (a plain matrix product, a custom autograd Function, a
weight used twice), and on the first microbatch of every input signature, where it checks how
the next ones may run (``passes``).

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
* Every use of a parameter in forward gets its own identity view (``ViewPerUse``, a
  ``TorchFunctionMode``, swaps the parameter for ``p.view_as(p)`` in each call), and W asks for
  the gradient of those views, not of the parameter. Without this, W re-running the upper of
  two frontier nodes that share a parameter (a layer applied twice, tied weights) would also
  recompute the input-gradient path down to the lower one, because autograd runs every node on
  a path to a requested gradient. Frontier nodes whose Q parts still meet (a tensor derived
  from a parameter and used twice) are re-run together, with their saved gradients pinned by
  pre-hooks, which keeps the result exact; only then can W redo the input-gradient path between
  them. Each view also numbers its use (call, argument), the order in which W sums a
  parameter's pieces (``accumulation``).
* B frees the activations W does not read (``memory``), found by reading the saved tensors of
  the nodes W will run, so memory follows the model: F allocates M_B, B frees M_B - M_W, W
  frees M_W. A node whose saved tensors cannot be read apart (``CopySlices``, an in-place change
  of a view) makes B keep them all.

A first stage that asks to be split (``split_first_stage``: an emulated stage does) has no input
that needs a gradient: I is then the part of the graph that depends on the inputs, found by
following them through forward (``DataFlow``), and B runs it down to its lowest nodes, keeping
the gradient arriving there.

Where W could not re-run the graph, B takes every parameter use at once instead
(``per_use_input``): calls inside other saved-tensor hooks (a checkpoint would recompute its
region again, once per saved tensor read outside a backward), and a first stage's first
microbatch, whose backward is all W's anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .. import engine
from ..memory import SavedActivations
from .accumulation import PREFIX, TensorHooksPaused, Uses
from .deferred import Deferral, deferrable, ours

__all__ = [
    "DataFlow", "ParamUses", "ViewPerUse", "Graph", "WeightGroup", "cut_input", "per_use_input", "run_groups", "pieces",
    "tensors_in",
]

# a reentrant torch.utils.checkpoint's node (its backward calls autograd again)
REENTRANT = "CheckpointFunctionBackward"
_COPY_SLICES = "torch::autograd::CopySlices"

# Parameter uses whose gradient is O(activations) (no matrix product): the fast path computes
# them in B.
_CHEAP = frozenset({
    "layer_norm", "rms_norm", "group_norm", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__",
    "mul", "__mul__", "__rmul__", "div", "__truediv__", "__getitem__",
})


class DataFlow:
    """The tensors of a forward that depend on the stage inputs, and their places in the graph."""

    def __init__(self, inputs: Sequence) -> None:
        self._tensors = WeakIdKeyDictionary({t: True for t in inputs if isinstance(t, torch.Tensor)})
        self.edges: set[tuple[Node, int]] = set()  # (grad_fn, output_nr) of such tensors

    def note(self, args, kwargs, out) -> None:
        """After a call: its outputs depend on the inputs if an argument does."""
        if any([self.seen(t) for t in tensors_in((args, kwargs))]):  # a list: seen() records every edge
            for t in tensors_in(out):
                self._tensors[t] = True
                self.seen(t)

    def seen(self, t: torch.Tensor) -> bool:
        """Whether ``t`` depends on the inputs (recording its place in the graph)."""
        if t not in self._tensors:
            return False
        if t.grad_fn is not None:  # read at each use: a custom Function sets it after its forward
            self.edges.add((t.grad_fn, t.output_nr))
        return True


def tensors_in(x) -> list[torch.Tensor]:
    """Every tensor in a nest of lists, tuples and dicts."""
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


@dataclass
class ParamUses:
    """Where a forward used one parameter (call numbers): in a Linear the split may defer, or
    otherwise."""

    deferred: list[int] = field(default_factory=list)
    other: list[int] = field(default_factory=list)


class ViewPerUse(TorchFunctionMode):
    """Replace each stage parameter by a fresh identity view in every torch call that uses it,
    numbering the uses (``keys``: view node -> (call, argument)), and follow the inputs' data
    flow when ``data`` is given.

    With a ``deferral``, Linears are deferred (outside other saved-tensor hooks, and unless the
    signature's verdict says not to). Without one (``record``: the first microbatch of a
    signature) nothing is deferred and every use is recorded in ``uses``, marking those a
    deferral would take, for the verdict. Views are made from the last argument to the first, so
    that autograd (which runs later nodes first) sums a call's uses in argument order, as
    unsplit. Under autocast a parameter is passed as it is: autocast casts it once and reuses
    the cast for all its uses there, whose gradients autograd sums before the cast back, and a
    view per use would give each its own cast."""

    def __init__(
        self, params: dict[int, nn.Parameter], views: dict[Node, nn.Parameter], keys: dict[Node, tuple],
        data: DataFlow | None, deferral: Deferral | None, pack: Callable, record: bool,
    ) -> None:
        super().__init__()
        self._params = params
        self._views = views
        self._keys = keys
        self._data = data
        self._deferral = deferral
        self._pack = pack
        self.uses: dict[int, ParamUses] | None = {} if record else None
        self.heavy = False  # a parameter used by an op outside _CHEAP (and not a Linear the split defers)
        self.opaque = False  # calls ran inside other saved-tensor hooks (see ``deferred.ours``)
        self._calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():  # grad-free code needs no split
            return func(*args, **kwargs)
        self._calls += 1
        call = self._calls
        lin = None
        if ours(self._pack):
            lin = deferrable(func, args, kwargs, self._params)
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

    def _mine(self, a) -> bool:
        return isinstance(a, nn.Parameter) and self._params.get(id(a)) is a

    def _swap(self, args: tuple, kwargs: dict, call: int, name: str, lin: tuple | None) -> tuple[tuple, dict]:
        found: list[nn.Parameter] = []  # the stage's parameters in this call, in argument order
        kept = [False]  # one passed as it is, under autocast
        for a in (*args, *kwargs.values()):
            self._collect(a, found, kept, call)
        if kept[0] and name not in _CHEAP:
            self.heavy = True
        if not found:
            return args, kwargs
        views: list[torch.Tensor] = list(found)
        for i in reversed(range(len(found))):  # the first argument's view last (see the class docstring)
            p = found[i]
            v = p.view_as(p)
            assert v.grad_fn is not None  # a view of a leaf that requires grad has one
            self._views[v.grad_fn] = p
            self._keys[v.grad_fn] = (call, i)
            views[i] = v
            linear = lin is not None and (p is lin[1] or p is lin[2])
            if self.uses is not None:
                u = self.uses.setdefault(id(p), ParamUses())
                (u.deferred if linear else u.other).append(call)
            if not linear and name not in _CHEAP:
                self.heavy = True
        it = iter(views)
        return tuple(self._replace(a, it) for a in args), {k: self._replace(v, it) for k, v in kwargs.items()}

    def _collect(self, a, found: list[nn.Parameter], kept: list[bool], call: int) -> None:
        if self._mine(a):
            if torch.is_autocast_enabled(a.device.type):
                kept[0] = True
                if self.uses is not None:
                    self.uses.setdefault(id(a), ParamUses()).other.append(call)
            else:
                found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                self._collect(x, found, kept, call)

    def _replace(self, a, views):
        if self._mine(a):
            return a if torch.is_autocast_enabled(a.device.type) else next(views)
        if isinstance(a, (list, tuple)) and any(isinstance(x, nn.Parameter) for x in a):
            return type(a)(self._replace(x, views) for x in a)
        return a


@dataclass(eq=False)
class WeightGroup:
    """A unit of W's work: graph parts re-run in one autograd call."""

    roots: list[GradientEdge]
    grads: list[torch.Tensor]
    pinned: list[tuple[Node, tuple]]  # frontier nodes re-run together: (node, saved grad)
    captures: dict[Node, nn.Parameter]  # where W collects gradients, and whose they are


def cut_input(
    outs: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor], data: DataFlow | None, graph: Graph,
    deferral: Deferral | None, saved: SavedActivations,
) -> tuple[list[torch.Tensor | None], list[WeightGroup]]:
    """B of the generic split: the gradients of ``inputs`` (None for each with ``data``: a first
    stage's, whose B runs the graph down to the lowest nodes depending on its inputs instead),
    and W's work. Frees every activation W does not read."""
    root_edges = [get_gradient_edge(o) for o in outs]
    # B also runs every deferred Linear (they lead to the anchor), leaving W their weights
    anchor = [deferral.anchor] if deferral is not None and deferral.records else []
    # B stops at the inputs, or for a first stage at the lowest nodes of I, whose work is all W's
    if data is None:
        targets: list = list(inputs)
    else:
        bottom = set(graph.bottom())
        targets = [GradientEdge(n, k) for n, k in data.edges if n in bottom]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    saved_grads: dict[Node, tuple] = {}
    handles = [n.register_prehook(_saver(saved_grads, n)) for n in graph.frontier]
    try:
        b_roots = [(o, g) for o, e, g in zip(outs, root_edges, grads) if anchor or graph.in_i(e.node)]
        if b_roots and (targets or anchor):
            b_outs, b_grads = [o for o, _ in b_roots], [g for _, g in b_roots]
            got = engine.grad(b_outs, targets + anchor, b_grads, retain_graph=True)[: len(targets)]
            if data is None:
                result = list(got)
            else:
                for e, g in zip(targets, got):
                    slots = list(saved_grads.get(e.node, ()))
                    slots += [None] * (e.output_nr + 1 - len(slots))
                    slots[e.output_nr] = g
                    saved_grads[e.node] = tuple(slots)
    finally:
        for h in handles:
            h.remove()
    groups = graph.weight_groups(root_edges, grads, saved_grads)
    # Keep the activations W reads (those saved by the nodes it re-runs), free the others.
    with saved.record() as keep:
        known = all([_touch_saved(node) for node in graph.weight_nodes(groups)])
    if deferral is not None:
        keep |= deferral.holders()
    if known:
        saved.keep_only(keep)
    return result, groups


def per_use_input(
    outs: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor], views: dict[Node, nn.Parameter],
    keys: dict[Node, tuple], params: list[nn.Parameter], direct: set[int], deferral: Deferral | None,
    saved: SavedActivations,
) -> tuple[list[torch.Tensor | None], list[tuple[nn.Parameter, torch.Tensor, tuple]]]:
    """B taking every parameter use at once, in one autograd call that frees the graph as it
    goes: the gradients of ``inputs``, and each per-use view's gradient (a parameter also used
    without a view, in ``direct``: its accumulator's, the sum autograd makes of all its uses)
    with its key, for W to add up. Frees every activation W does not read."""
    captures: list[tuple[GradientEdge, nn.Parameter, tuple]] = [
        (GradientEdge(n, 0), p, keys[n]) for n, p in views.items() if id(p) not in direct
    ]
    captures += [(get_gradient_edge(p), p, PREFIX) for p in params if id(p) in direct]
    anchor = [deferral.anchor] if deferral is not None and deferral.records else []
    targets = [*inputs, *anchor, *(e for e, _, _ in captures)]
    got: Sequence[torch.Tensor | None] = [None] * len(targets)
    if outs and targets:
        with saved.consuming(), TensorHooksPaused(params):
            got = engine.grad(outs, targets, grads)
    saved.keep_only(deferral.holders() if deferral is not None else set())
    start = len(inputs) + len(anchor)
    early = [(p, g, key) for (_, p, key), g in zip(captures, got[start:]) if g is not None]
    return list(got[: len(inputs)]), early


def run_groups(groups: list[WeightGroup], keys: dict[Node, tuple], uses: Uses) -> None:
    """W's part of the generic split: each group re-run from its frontier, its gradients given
    to ``uses`` at their places in the order of uses (a parameter's accumulator: ``PREFIX``)."""
    for group in groups:
        handles = [n.register_prehook(_pin(g)) for n, g in group.pinned] if len(group.pinned) > 1 else []
        try:
            with TensorHooksPaused(group.captures.values()):
                got = engine.grad(group.roots, [GradientEdge(n, 0) for n in group.captures], group.grads, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        for (node, p), pg in zip(group.captures.items(), got):
            uses.add(p, pg, keys.get(node, PREFIX))


def pieces(groups: list[WeightGroup]) -> list[nn.Parameter]:
    """The parameters ``run_groups`` gives a gradient to, once per piece."""
    return [p for g in groups for p in g.captures.values()]


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


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(cls: type) -> tuple[str, ...]:
    names = _SAVED_NAMES.get(cls)
    if names is None:
        names = _SAVED_NAMES[cls] = tuple(n for n in dir(cls) if n.startswith("_saved_"))
    return names


class Graph:
    """The autograd graph of one stage forward, classified for the B/W split.

    Nodes are classified bottom-up: ``reach_i`` (a path to a stage input: the set I) and
    ``reach_q`` (a path to a capture point, where W collects parameter gradients). Q is
    reach_q minus I.
    """

    def __init__(
        self, roots: list[Node], input_nodes: set[Node], views: dict[Node, nn.Parameter], params: list[nn.Parameter],
    ) -> None:
        # Each view's only child is its parameter's accumulator; unviewed parameters need a lookup.
        param_acc: dict[Node, nn.Parameter] = {}
        for v, p in views.items():
            acc = v.next_functions[0][0]
            assert acc is not None  # the parameter requires grad, so it has an accumulator
            param_acc[acc] = p
        viewed = {id(p) for p in views.values()}
        param_acc.update({get_gradient_edge(p).node: p for p in params if id(p) not in viewed})
        children: dict[Node, list[Node]] = {}
        order: list[Node] = []  # children before parents
        direct: set[int] = set()  # parameters some node uses without a per-use view
        self.reentrant = False  # a reentrant checkpoint's node is in the graph
        stack = [(r, False) for r in roots]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
            elif node not in children:
                kids = children[node] = [c for c, _ in node.next_functions if c is not None]
                if node.name() == REENTRANT:
                    self.reentrant = True
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
        """Whether ``node`` leads to a stage input (part of B)."""
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

    def weight_nodes(self, groups: list[WeightGroup]) -> set[Node]:
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

    def weight_groups(self, root_edges: list[GradientEdge], grads: list, saved_grads: dict[Node, tuple]) -> list[WeightGroup]:
        """W's units of work: each frontier node with the gradients B saved for it, plus an all-weight first-stage graph."""
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
        groups: dict[int, WeightGroup] = {}
        for i, (roots, gs, node, part) in enumerate(units):
            g = groups.setdefault(find(i), WeightGroup([], [], [], {}))
            g.roots += roots
            g.grads += gs
            if node is not None:
                g.pinned.append((node, saved_grads[node]))
            g.captures.update((q, self.capture[q]) for q in part if q in self.capture)
        return [g for g in groups.values() if g.captures]
