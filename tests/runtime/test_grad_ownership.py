"""A parameter's new ``.grad`` is W's gradient itself only where nothing else holds it.

Autograd's accumulator keeps a gradient as ``.grad`` without a copy when nothing else references
it; the split's W does the same, and must copy anywhere else: ``.grad`` is added to in place by
the next microbatch, so a tensor taken while something else still reads it (an input gradient
on its way to another stage, another parameter's gradient, a gradient a pending W re-runs from)
would be changed under it. Checked three ways:

* the check itself, state by state: a tensor that nothing else holds is taken, and a tensor held
  from Python, from C++ (a saved tensor of a live graph), through a view, a base or its memory, or
  laid out as no ``.grad`` is, is copied, and the holders still read what they held after the
  next microbatch adds to ``.grad``;
* stages whose parameter gradients alias each other, the stage's input gradient or its output
  gradient (parameters added as they are, broadcast, expanded, viewed, concatenated, used twice,
  transposed, a Function handing one tensor to two inputs, experts combined with ``index_add_``),
  alone and with generated stages (``tests.helpers.programs``) chained into a pipeline that holds
  each tensor only as long as a runtime does: gradients, input gradients and hook events bit for
  bit those of ``loss.backward()`` after every microbatch, in random orders of F, B, W and BW;
* on a stage whose gradients nothing else holds, the first microbatch copies none.
"""

from __future__ import annotations

import copy
import random
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers import split_oracle as oracle
from tests.helpers.programs import B, D, Program, T, V
from zbsearch.runtime import backward_full, backward_input, backward_weight, forward_pass
from zbsearch.runtime.split import accumulation
from zbsearch.runtime.split.accumulation import PREFIX, Uses

# -- the check, state by state -----------------------------------------------------------------


def _param(*shape, transposed: bool = False) -> nn.Parameter:
    if transposed:
        return nn.Parameter(torch.randn(*reversed(shape)).t())
    return nn.Parameter(torch.randn(*shape))


def _state(name: str):
    """(parameter, gradient, what else holds it (kept alive), whether it may be taken)."""
    p = _param(4, 3)
    g = torch.randn(4, 3)
    if name == "alone":
        return p, g, [], True
    if name == "held":
        return p, g, [g], False
    if name == "in a closure":
        return p, g, [lambda: g], False
    if name == "a view of it alive":
        return p, g, [g[1:]], False
    if name == "a view of it saved by a graph":
        x = torch.randn(2, 3, requires_grad=True)
        return p, g, [x * g[:2]], False
    if name == "saved by a graph":
        x = torch.randn(4, 3, requires_grad=True)
        return p, g, [x * g], False
    if name == "its memory's object held":
        return p, g, [g.untyped_storage()], False
    if name == "another parameter's grad":
        q = _param(4, 3)
        q.grad = g
        return p, g, [q], False
    if name == "a view of a tensor nothing holds":
        return p, torch.randn(12).view(4, 3), [], True
    if name == "a view of a held tensor":
        base = torch.randn(12)
        return p, base.view(4, 3), [base], False
    if name == "a view of a tensor saved by a graph":
        base = torch.randn(12)
        x = torch.randn(12, requires_grad=True)
        return p, base.view(4, 3), [x * base], False
    if name == "a view of part of a tensor":
        return p, torch.randn(5, 3)[:4], [], False
    if name == "expanded":
        return p, torch.randn(1, 3).expand(4, 3), [], False
    if name == "transposed":
        return p, torch.randn(3, 4).t(), [], False
    if name == "laid out as its transposed parameter":
        return _param(4, 3, transposed=True), torch.randn(3, 4).t(), [], True
    if name == "contiguous for a transposed parameter":
        return _param(4, 3, transposed=True), g, [], False
    if name == "requires grad":
        return p, torch.randn(4, 3, requires_grad=True), [], False
    if name == "conjugate":
        return nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat)), torch.randn(4, 3, dtype=torch.cfloat).conj(), [], False
    raise ValueError(name)


STATES = [
    "alone", "held", "in a closure", "a view of it alive", "a view of it saved by a graph", "saved by a graph",
    "its memory's object held", "another parameter's grad", "a view of a tensor nothing holds", "a view of a held tensor",
    "a view of a tensor saved by a graph", "a view of part of a tensor", "expanded", "transposed",
    "laid out as its transposed parameter", "contiguous for a transposed parameter", "requires grad", "conjugate",
]


def _values(x):
    """Clones of every tensor ``x`` reaches (a graph's saved tensors included), to compare later."""
    if isinstance(x, nn.Parameter):
        return _values(x.grad)
    if isinstance(x, torch.Tensor):
        out = [x.detach().clone()]
        if x.grad_fn is not None:
            out += [t.detach().clone() for t in _saved(x.grad_fn)]
        return out
    if isinstance(x, torch.UntypedStorage):
        return [torch.empty(0, dtype=torch.uint8).set_(x).clone()]
    if callable(x):
        return _values(x())
    return []


def _saved(node) -> list[torch.Tensor]:
    return [getattr(node, n) for n in dir(node) if n.startswith("_saved_") and isinstance(getattr(node, n), torch.Tensor)]


def _give(p: nn.Parameter, box: list) -> None:
    """One W's gradient for ``p``, handed over from ``box`` (so the caller keeps none)."""
    uses = Uses([p])
    uses.add(p, box.pop(), PREFIX)
    uses.finish()


@pytest.mark.parametrize("name", STATES)
def test_a_gradient_is_taken_only_where_nothing_else_holds_it(name):
    torch.manual_seed(0)
    p, g, keep, taken = _state(name)
    want = g.detach().clone()
    ptr = g.untyped_storage().data_ptr()
    before = [v for k in keep for v in _values(k)]
    box = [g]
    del g
    _give(p, box)
    assert torch.equal(p.grad, want)
    assert (p.grad.untyped_storage().data_ptr() == ptr) == taken, "taken" if not taken else "copied"
    assert not p.grad._is_view()
    assert p.grad.stride() == p.stride(), "a new .grad laid out as autograd lays it out"
    nxt = torch.randn_like(want)
    _give(p, [nxt])
    assert torch.equal(p.grad, want + nxt)
    after = [v for k in keep for v in _values(k)]
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after)), \
        "a holder's tensor changed with .grad"


def test_one_tensor_for_two_parameters_is_taken_once():
    """Autograd passes one tensor on to two parameters (``x + p + q``): one takes it, the
    other a copy, and the next microbatch's add to one leaves the other as it was."""
    p, q = _param(4, 3), _param(4, 3)
    box = [torch.randn(4, 3)]
    want = box[0].clone()
    uses = Uses([p, q])
    uses.add(p, box[0], PREFIX)
    uses.add(q, box.pop(), PREFIX)
    uses.finish()
    assert p.grad.untyped_storage().data_ptr() != q.grad.untyped_storage().data_ptr()
    _give(p, [torch.ones(4, 3)])
    assert torch.equal(q.grad, want) and torch.equal(p.grad, want + 1)


def test_a_gradient_only_a_weak_reference_holds_is_taken():
    """As autograd: a weak reference keeps nothing alive, so it does not stop the take."""
    p = _param(4, 3)
    box = [torch.randn(4, 3)]
    ref = weakref.ref(box[0])
    _give(p, box)
    assert ref() is p.grad


# -- stages whose gradients alias ------------------------------------------------------------------


class SameToBoth(torch.autograd.Function):
    """``x + p`` whose backward hands the one output gradient to both inputs."""

    @staticmethod
    def forward(ctx, x, p):
        return x + p

    @staticmethod
    def backward(ctx, g):
        return g, g


KINDS = ["pass", "pass-twice", "broadcast", "expand", "view", "cat", "scale", "twice", "matmul-twice", "transposed",
         "same-to-both", "experts", "tanh"]


class Aliasing(nn.Module):
    """A middle stage ``(h, ids) -> (h, ids)`` (or a last one, ``h``) whose parameters' gradients
    alias: each step one way model code uses a parameter."""

    def __init__(self, rng: random.Random, where: str = "middle", n: int | None = None) -> None:
        super().__init__()
        self.where = where
        self.steps: list[tuple] = []
        for i in range(n if n is not None else rng.randint(2, 6)):
            kind = rng.choice(KINDS)
            name = f"p{i}"
            if kind in ("pass", "same-to-both"):
                self.register_parameter(name, nn.Parameter(torch.randn(B, T, D)))
            elif kind == "pass-twice":
                self.register_parameter(name, nn.Parameter(torch.randn(B, T, D)))
                self.register_parameter(name + "b", nn.Parameter(torch.randn(B, T, D)))
            elif kind == "broadcast":
                self.register_parameter(name, nn.Parameter(torch.randn(*rng.choice([(D,), (T, D), (1, T, 1), (B, 1, D)]))))
            elif kind == "expand":
                self.register_parameter(name, nn.Parameter(torch.randn(1, T, D)))
            elif kind == "view":
                self.register_parameter(name, nn.Parameter(torch.randn(B * T * D)))
            elif kind == "cat":
                self.register_parameter(name, nn.Parameter(torch.randn(B, T, D // 2)))
                self.register_parameter(name + "b", nn.Parameter(torch.randn(B, T, D // 2)))
            elif kind == "scale":
                self.register_parameter(name, nn.Parameter(torch.rand(D) + 0.5))
            elif kind == "twice":
                self.add_module(name, nn.Linear(D, D, bias=rng.random() < 0.5))
            elif kind in ("matmul-twice", "transposed"):
                w = torch.randn(D, D) / D**0.5
                self.register_parameter(name, nn.Parameter(w.t() if kind == "transposed" else w))
            elif kind == "experts":
                self.add_module(name, nn.ModuleList([nn.Linear(D, D) for _ in range(3)]))
                self.add_module(name + "r", nn.Linear(D, 3, bias=False))
            self.steps.append((kind, name))

    def describe(self) -> str:
        return f"{self.where}: " + ", ".join(k for k, _ in self.steps)

    def forward(self, h, ids=None):
        for kind, name in self.steps:
            h = getattr(self, "_" + kind.replace("-", "_"))(h, name)
        return h if self.where == "last" else (h, ids)

    def _pass(self, h, n):
        return h + getattr(self, n)

    def _pass_twice(self, h, n):
        return (h + getattr(self, n)) + getattr(self, n + "b")

    def _broadcast(self, h, n):
        return h + getattr(self, n)

    def _expand(self, h, n):
        return h + getattr(self, n).expand(B, T, D)

    def _view(self, h, n):
        return h + getattr(self, n).view(B, T, D)

    def _cat(self, h, n):
        return h + torch.cat([getattr(self, n), getattr(self, n + "b")], -1)

    def _scale(self, h, n):
        return h * getattr(self, n)

    def _twice(self, h, n):
        lin = getattr(self, n)
        return lin(torch.tanh(lin(h)))

    def _matmul_twice(self, h, n):
        m = getattr(self, n)
        return torch.tanh(h @ m) + h @ m.t()

    def _transposed(self, h, n):
        return h @ getattr(self, n)

    def _same_to_both(self, h, n):
        return SameToBoth.apply(h, getattr(self, n))

    def _experts(self, h, n):
        experts, router = getattr(self, n), getattr(self, n + "r")
        flat = h.reshape(-1, D)
        weights, chosen = router(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot].unsqueeze(-1))
        return h + out.reshape(h.shape)

    def _tanh(self, h, n):
        return torch.tanh(h)


def _inputs(g: torch.Generator, m: int) -> list[list]:
    return [[torch.randn(B, T, D, generator=g).requires_grad_(), torch.randint(0, V, (B, T), generator=g)] for _ in range(m)]


@pytest.mark.parametrize("seed", range(12))
def test_an_aliasing_stage_is_exact(seed):
    """One stage, the oracle's random pass orders; the output gradient one tensor for every
    microbatch on odd seeds (a piece of a later microbatch's W)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    last = seed % 3 == 2
    module = Aliasing(rng, "last" if last else "middle")
    m = rng.randint(3, 5)
    g = torch.Generator().manual_seed(seed)
    inputs = _inputs(g, m)
    if last:
        targets = [torch.randn(B, T, D, generator=g) for _ in range(m)]
        posts = [lambda o, t=t: F.mse_loss(o, t) for t in targets]
        grads = [[torch.ones(())] for _ in range(m)]
    else:
        posts = None
        shared = torch.randn(B, T, D, generator=g)
        grads = [[shared if seed % 2 else torch.randn(B, T, D, generator=g), None] for _ in range(m)]
    order = oracle.pipeline_order(rng, m, fuse=0.2)
    hooks = rng.random() < 0.4
    ref, ours = module, copy.deepcopy(module)
    want = oracle.reference(ref, inputs, grads, post=posts, hooks=oracle.Hooked(ref) if hooks else None)
    got = oracle.split(ours, inputs, grads, order, post=posts, hooks=oracle.Hooked(ours) if hooks else None)
    oracle.assert_same(got, want, f"seed {seed}, order {order}\n{module.describe()}")


def _stage(rng: random.Random, s: int, p: int, seed: int) -> nn.Module:
    """Stage ``s`` of ``p``: an aliasing stage, or a generated one (deterministic: eval mode;
    none with an in-place change autograd refuses)."""
    where = "last" if s == p - 1 else "middle"
    torch.manual_seed(seed * 10 + s)
    if rng.random() < 0.6:
        return Aliasing(rng, where)
    prog = Program(rng, "middle")
    while any(st[0] == "inplace-input" and st[1] for st in prog.steps):
        prog = Program(rng, "middle")
    prog.eval()  # dropout off and norms fixed: the same forward in any order
    if where == "last":
        return _Last(prog)
    return prog


class _Last(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def describe(self) -> str:
        return "last: " + self.inner.describe()

    def forward(self, h, ids):
        return self.inner(h, ids)[0]


def _pipeline_order(rng: random.Random, p: int, m: int, fuse: float) -> list[tuple[str, int, int]]:
    """A random order of every pass (op, stage, microbatch) of a p-stage pipeline: per stage F,
    B and W each in microbatch order; F(s, j) after F(s-1, j), B(s, j) after B(s+1, j), W
    after its B; a fused BW where B would run, after the stage's earlier W."""
    fused = {(s, j) for s in range(p) for j in range(m) if rng.random() < fuse}
    nxt = {(op, s): 0 for op in "FBW" for s in range(p)}
    order: list[tuple[str, int, int]] = []
    while any(nxt[("W", s)] < m for s in range(p)):
        ready = []
        for s in range(p):
            j = nxt[("F", s)]
            if j < m and (s == 0 or nxt[("F", s - 1)] > j):
                ready.append(("F", s))
            j = nxt[("B", s)]
            if (j < nxt[("F", s)] and (s == p - 1 or nxt[("B", s + 1)] > j)
                    and ((s, j) not in fused or nxt[("W", s)] == j)):
                ready.append(("B", s))
            if nxt[("W", s)] < nxt[("B", s)]:
                ready.append(("W", s))
        op, s = rng.choice(ready)
        j = nxt[(op, s)]
        nxt[(op, s)] += 1
        if op == "B" and (s, j) in fused:
            order.append(("BW", s, j))
            nxt[("W", s)] = j + 1
        else:
            order.append((op, s, j))
    return order


@pytest.mark.parametrize("seed", range(10))
def test_a_pipeline_of_aliasing_stages_is_exact(seed):
    """Stages chained in one process, each tensor held only while a runtime holds it: an
    activation until its stage's F, an input gradient until the previous stage's B. A
    gradient taken while still needed would change under its reader: the next stage's
    gradients or the hook events would differ from ``loss.backward()``'s."""
    rng = random.Random(seed)
    p, m = rng.randint(2, 3), rng.randint(3, 4)
    stages = [_stage(rng, s, p, seed) for s in range(p)]
    what = f"seed {seed}\n" + "\n".join(st.describe() for st in stages)  # type: ignore[operator]
    g = torch.Generator().manual_seed(seed)
    first = _inputs(g, m)
    targets = [torch.randn(B, T, D, generator=g) for _ in range(m)]
    posts = [lambda o, t=t: F.mse_loss(o, t) for t in targets]
    hooks = rng.random() < 0.4

    # the reference: each stage alone, loss.backward() per microbatch, from the last stage down
    refs = copy.deepcopy(stages)
    acts = [first]
    for st in refs[:-1]:  # with grad mode, as in a pass (without it, attention takes another kernel)
        acts.append([[st(*[oracle.leaf(x) for x in xs])[0].detach().requires_grad_(), xs[1]] for xs in acts[-1]])
    want: list[oracle.Outcome] = [oracle.Outcome()] * p
    grads = [[torch.ones(())] for _ in range(m)]
    for s in reversed(range(p)):
        want[s] = oracle.reference(refs[s], acts[s], grads, post=posts if s == p - 1 else None,
                                   hooks=oracle.Hooked(refs[s]) if hooks else None)
        grads = [[gi[0], None] for gi in want[s].input_grads]

    hooked = [oracle.Hooked(st) if hooks else None for st in stages]
    x_in: dict[tuple[int, int], list] = {(0, j): [oracle.leaf(x) for x in first[j]] for j in range(m)}
    g_in: dict[tuple[int, int], list] = {(p - 1, j): [torch.ones(())] for j in range(m)}
    passes, weights = {}, {}
    order = _pipeline_order(rng, p, m, fuse=0.2)
    fused = {(s, j) for op, s, j in order if op == "BW"}
    for op, s, j in order:
        if op == "F":
            xs = x_in.pop((s, j))
            fp = passes[(s, j)] = forward_pass(stages[s], xs, split=(s, j) not in fused,
                                               post=posts[j] if s == p - 1 else None)
            del xs
            if s + 1 < p:  # what the next stage receives: a copy of the activation
                x_in[(s + 1, j)] = [oracle.leaf(fp.outputs[0].detach()).requires_grad_(), first[j][1]]
            continue
        if op == "W":
            backward_weight(weights.pop((s, j)))
        else:
            gs = g_in.pop((s, j))
            if s + 1 < p:
                gs = [gs[0], None]
            if op == "BW":
                gi = backward_full(passes.pop((s, j)), gs)
            else:
                gi, weights[(s, j)] = backward_input(passes.pop((s, j)), gs)
            del gs
            got = gi[0]
            assert oracle._equal(got, want[s].input_grads[j][0]), f"{what}\nstage {s} microbatch {j}: input gradient"
            if s > 0:
                g_in[(s - 1, j)] = [got]  # sent: held until the previous stage's B
            del gi, got
        if op != "B":  # the microbatch's gradients are in
            grads_now = {n: None if q.grad is None else q.grad.clone() for n, q in stages[s].named_parameters()}
            for n, w in want[s].param_grads[j].items():
                assert oracle._equal(grads_now[n], w), f"{what}\nstage {s} microbatch {j}: {n}.grad"
            if hooked[s] is not None:
                assert sorted(hooked[s].take()) == sorted(want[s].hooks[j]), f"{what}\nstage {s} microbatch {j}: hooks"
    assert not passes and not weights and not g_in and not x_in


# -- a stage whose gradients nothing else holds copies none ------------------------------------------


class _Heavy(nn.Module):
    """Parameters used as no Linear is (the generic split, gradients from W's own autograd
    call), and 3-D expert weights indexed per expert, as Hugging Face MoE layers use them."""

    def __init__(self) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.experts = nn.Parameter(torch.randn(3, D, D) / D**0.5)
        self.norm = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)

    def forward(self, h):
        h = self.norm(h @ self.m)
        for e in range(3):
            h = h + torch.tanh(F.linear(h, self.experts[e]))
        return self.lin(h)


def test_no_copy_where_nothing_else_holds_a_gradient(monkeypatch):
    copies = []
    real = accumulation._copy
    monkeypatch.setattr(accumulation, "_copy", lambda g, p: copies.append(tuple(p.shape)) or real(g, p))
    torch.manual_seed(0)
    stage, ref = _Heavy(), None
    ref = copy.deepcopy(stage)
    for j in range(3):
        x = torch.randn(B, T, D, requires_grad=True)
        gy = torch.randn(B, T, D)
        fp = forward_pass(stage, [x.detach().requires_grad_()])
        gi, w = backward_input(fp, [gy.clone()])
        del gi, fp
        backward_weight(w)
        ref(x).backward(gy)
        for (n, q), r in zip(stage.named_parameters(), ref.parameters()):
            assert torch.equal(q.grad, r.grad), f"microbatch {j}: {n}.grad"
    assert not copies, f"copied: {copies}"
