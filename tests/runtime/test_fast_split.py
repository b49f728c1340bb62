"""The split backward's fast path (deferred Linear weight gradients, cheap parameter uses in B):
gradients equal to one plain ``loss.backward()`` microbatch after microbatch, on the layers it
takes, on a generic fallback for everything else, and on first stages (whole backward in W,
plain or deferred, or split on request)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zbsearch.models import GPTConfig, gpt_loss, gpt_stages, llama_stages
from zbsearch.models.gpt import Attention
from zbsearch.models.llama import LlamaBlock
from zbsearch.runtime import EmulatedStage, backward_input, backward_weight, forward_pass
from zbsearch.runtime.memory import ActivationMeter


class Tied(nn.Module):
    """An embedding whose table is also the output head, and a Linear applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, ids):
        h = self.lin(torch.tanh(self.lin(self.ln(self.emb(ids)))))
        return F.linear(h, self.emb.weight)


class Functional(nn.Module):
    """F.linear by keyword, a parameter used elementwise twice, a bias-free Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))
        self.b = nn.Parameter(torch.randn(6))
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.out = nn.Linear(6, 4, bias=False)

    def forward(self, x):
        h = F.linear(input=x, weight=self.w, bias=self.b) * self.scale
        return self.out(torch.relu(h) + self.scale)


class TiedMiddle(nn.Module):
    """``Tied`` on a middle stage: a weight in F.embedding (of ids made inside) and F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        ids = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        h = self.lin(torch.tanh(self.lin(x + self.emb(ids))))
        return F.linear(h, self.emb.weight)


class HeavyFirst(nn.Module):
    """A first stage on float data that needs no gradient: a Linear on the data itself, and a
    parameter in plain products, used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.m = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, ids):
        x = F.one_hot(ids, 8).float()
        return torch.tanh(torch.tanh(self.lin(x)) @ self.m) @ self.m


class EmulatedFirst(EmulatedStage):
    def __init__(self) -> None:
        super().__init__(0, 0, 0, b_bytes=64, w_bytes=32)

    def forward(self, ids):
        return super().forward(F.one_hot(ids, 16).float())


class Heavy(nn.Module):
    """A parameter in a plain matrix product: not a use the fast path takes (generic split)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.m = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return torch.tanh(self.lin(x)) @ self.m


def _gpt(stage):
    cfg = GPTConfig(layers=3, hidden=16, heads=2, seq=8, vocab=32, microbatch_size=2, stages=3)
    return gpt_stages(cfg)[stage]


def _llama(stage):
    cfg = GPTConfig(layers=3, hidden=16, heads=2, seq=8, vocab=32, microbatch_size=2, stages=3)
    return llama_stages(cfg)[stage]


def _split_first(make):
    """The module, asking for a split first stage (B the activation-gradient work, W the rest)."""

    def build():
        mod = make()
        mod.split_first_stage = True
        return mod

    return build


def _ids(n, *shape):
    return lambda: torch.randint(0, n, shape)


# name: (module, sample input, whether later microbatches take the fast path, or "whole": a first
# stage, whose whole backward is W's)
CASES = {
    "linear": (lambda: nn.Linear(8, 5), lambda: torch.randn(3, 4, 8), True),
    "attention": (lambda: Attention(16, 2), lambda: torch.randn(2, 8, 16), True),
    "layernorm": (lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), lambda: torch.randn(3, 8), True),
    "embedding": (lambda: nn.Sequential(nn.Embedding(13, 8), nn.Linear(8, 3)), _ids(13, 3, 5), "whole"),
    "tied-twice": (Tied, _ids(11, 2, 6), "whole"),
    "tied-twice-middle": (TiedMiddle, lambda: torch.randn(2, 6, 8), False),
    "functional": (Functional, lambda: torch.randn(3, 5), True),
    "llama-block": (lambda: LlamaBlock(16, 2, 8), lambda: torch.randn(2, 8, 16), True),
    "gpt-first": (lambda: _gpt(0), _ids(32, 2, 8), "whole"),
    "gpt-middle": (lambda: _gpt(1), lambda: torch.randn(2, 8, 16), True),
    "gpt-last": (lambda: _gpt(2), lambda: torch.randn(2, 8, 16), True),
    "llama-first": (lambda: _llama(0), _ids(32, 2, 8), "whole"),
    "llama-last": (lambda: _llama(2), lambda: torch.randn(2, 8, 16), True),
    "heavy": (Heavy, lambda: torch.randn(3, 8), False),
    "heavy-first": (HeavyFirst, _ids(8, 3), "whole"),
    "emulated": (lambda: EmulatedStage(0, 0, 0, b_bytes=64, w_bytes=32), lambda: torch.randn(2, 16), False),
    # first stages split on request: the generic split, following the data from the inputs
    "gpt-first-split": (_split_first(lambda: _gpt(0)), _ids(32, 2, 8), False),
    "tied-twice-split": (_split_first(Tied), _ids(11, 2, 6), False),
    "heavy-first-split": (_split_first(HeavyFirst), _ids(8, 3), False),
    "emulated-first": (EmulatedFirst, _ids(16, 2), False),  # EmulatedStage asks for it
}


def _leaf(x):
    return x.detach().clone().requires_grad_(x.is_floating_point())


# first stages whose W runs B's and W's parts of the fast path (what the profiler picks where
# that measures faster than one plain backward): the fast path after the first microbatch
DEFERRED_FIRST = [n for n, (_, _, fast) in CASES.items() if fast == "whole"]


@pytest.mark.parametrize(("name", "deferred"), [(n, False) for n in CASES] + [(n, True) for n in DEFERRED_FIRST])
def test_split_gradients_equal_autograd_microbatch_after_microbatch(name, deferred):
    make, sample, fast = CASES[name]
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    taken = []
    for mb in range(3):
        x = sample()
        xr, xo = _leaf(x), _leaf(x)
        out = ref(xr)
        g = torch.randn_like(out)
        out.backward(g)  # accumulates over microbatches, as the runtime's W passes do
        fp = forward_pass(ours, [xo], deferred_first=deferred)
        taken.append(("deferred" if fp.fast else "checked" if fp.views else "whole") if fp.whole_in_w else fp.fast)
        before = [None if q.grad is None else q.grad.clone() for q in ours.parameters()]
        got, w = backward_input(fp, [g])
        if fp.whole_in_w:  # B leaves everything to W
            assert all(_same(q.grad, b) for q, b in zip(ours.parameters(), before))
        backward_weight(w)
        if xr.requires_grad:
            torch.testing.assert_close(got[0], xr.grad, msg=f"{name} microbatch {mb}: input gradient")
        else:
            assert got[0] is None
        for (pname, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda e, mb=mb, pname=pname: f"{name} microbatch {mb} {pname}: {e}")
            # as from loss.backward(): no history, which would keep every microbatch's graph alive
            assert q.grad is None or not q.grad.requires_grad, f"{name} microbatch {mb} {pname}: .grad has a graph"
    # the first microbatch of a signature checks the graph; later ones take the fast path if they may
    if deferred:
        assert taken == ["checked", "deferred", "deferred"]
    else:
        assert taken == (["whole"] * 3 if fast == "whole" else [False, fast, fast])


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_fast_path_is_rechecked_when_the_inputs_change():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    for shape, want in [((2, 8), False), ((2, 8), True), ((3, 8), False), ((3, 8), True)]:
        fp = forward_pass(mod, [torch.randn(shape, requires_grad=True)])
        assert fp.fast is want, shape
        _, w = backward_input(fp, [torch.randn(shape)])
        backward_weight(w)


def test_loss_in_the_stage_and_first_stage_without_input_gradient():
    """The last stage's loss runs inside the forward (``post``); the first stage's token ids
    need no gradient and B returns none for them."""
    cfg = GPTConfig(layers=2, hidden=16, heads=2, seq=8, vocab=32, microbatch_size=2, stages=1)
    torch.manual_seed(0)
    ref = gpt_stages(cfg)[0]
    ours = copy.deepcopy(ref)
    for _ in range(3):
        ids = torch.randint(0, 32, (2, 8))
        targets = torch.randint(0, 32, (2, 8))
        gpt_loss(ref(ids), targets).backward()
        fp = forward_pass(ours, [ids], post=lambda o, targets=targets: gpt_loss(o, targets))
        got, w = backward_input(fp, [torch.ones(())])
        assert got == [None]
        backward_weight(w)
        for (pname, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=pname)


@pytest.mark.parametrize(("first", "deferred"), [(False, False), (True, False), (True, True)])
def test_b_frees_all_but_what_w_reads(first, deferred):
    """On the fast path only the deferred layers' inputs stay after B (what W reads: the first
    Linear's input and the LayerNorm's output, float32). A first stage's B frees nothing: its
    whole backward is W's, deferred or not. W frees the rest."""
    torch.manual_seed(0)
    body = [nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8)]
    mod = nn.Sequential(nn.Embedding(13, 8), *body) if first else nn.Sequential(*body)
    for mb in range(2):
        meter = ActivationMeter()
        x = torch.randint(0, 13, (4, 6)) if first else torch.randn(4, 6, 8, requires_grad=True)
        fp = forward_pass(mod, [x], meter=meter, deferred_first=deferred)
        assert fp.fast is (mb == 1 and (deferred or not first)) and fp.whole_in_w is first
        after_f = meter.bytes
        _, w = backward_input(fp, [torch.randn(4, 6, 8)])
        after_b = meter.bytes
        backward_weight(w)
        assert meter.bytes == 0
        if first:
            assert after_b == after_f > 0
        else:
            assert 0 < after_b < after_f
        if fp.fast and not first:  # the generic split (first microbatch) also keeps what LayerNorm's W re-run reads
            assert after_b == 4 * 6 * (8 + 16) * 4


class Switch(nn.Module):
    """Uses a Linear's weight in a plain product only when told to: a use the first
    microbatch did not show."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.extra = False

    def forward(self, x):
        h = self.lin(self.ln(x))
        return h @ self.lin.weight if self.extra else h


def test_fast_path_stays_exact_when_a_later_microbatch_uses_a_parameter_differently():
    torch.manual_seed(0)
    ref = Switch()
    ours = copy.deepcopy(ref)
    for mb, extra in enumerate([False, False, True, False]):
        ref.extra = ours.extra = extra
        x = torch.randn(3, 6)
        xr, xo = _leaf(x), _leaf(x)
        g = torch.randn(3, 6)
        ref(xr).backward(g)
        fp = forward_pass(ours, [xo])
        assert fp.fast is (mb > 0)
        got, w = backward_input(fp, [g])
        backward_weight(w)
        torch.testing.assert_close(got[0], xr.grad)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"microbatch {mb} {name}")


class InPlace(nn.Module):
    """A Linear whose output is changed in place, as stage code does, on an input of any rank
    and layout."""

    def __init__(self, op: str, layout: str, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6, bias=bias)
        self.out = nn.Linear(6, 6)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 6))
        self.relu = nn.ReLU(inplace=True)
        self.op, self.layout = op, layout

    def forward(self, x):
        x = x * 1.5
        if self.layout == "transposed" and x.dim() >= 2:
            x = x.transpose(0, -2)
        elif self.layout == "strided":
            x = torch.cat([x, x], -1)[..., ::2]
        elif self.layout == "expanded":
            x = x[:1].expand(x.shape)
        u = self.fc(x)
        if self.op == "mul_":
            u.mul_(self.gain)
        elif self.op == "relu-inplace":
            F.relu(u, inplace=True)
        elif self.op == "ReLU(inplace)":
            u = self.relu(u)
        elif self.op == "+=":
            u += x
        elif self.op == "tanh_":
            u.tanh_()
        return self.out(u)


_SHAPES = {1: (6,), 2: (4, 6), 3: (2, 3, 6), 4: (2, 2, 3, 6)}


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["mul_", "relu-inplace", "ReLU(inplace)", "+=", "tanh_"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "expanded"])
def test_linear_outputs_changed_in_place_are_exact_at_any_rank(rank, op, layout):
    """Bit for bit ``loss.backward()`` microbatch after microbatch, through the check and the fast
    path, with activations the unsplit forward's."""
    import random

    from tests.helpers import split_oracle as oracle

    for bias in (True, False):
        torch.manual_seed(rank)
        ref = InPlace(op, layout, bias)
        ours = copy.deepcopy(ref)
        m = 5
        inputs = [[torch.randn(_SHAPES[rank], requires_grad=True)] for _ in range(m)]
        with torch.no_grad():
            grads = [[torch.randn_like(ref(*x))] for x in inputs]
        order = oracle.pipeline_order(random.Random(rank), m, fuse=0.2)
        got = oracle.split(ours, inputs, grads, order)
        oracle.assert_same(got, oracle.reference(ref, inputs, grads), f"rank {rank} {op} {layout} bias={bias}")


@pytest.mark.parametrize(("name", "deferred"), [(n, False) for n in CASES] + [(n, True) for n in DEFERRED_FIRST])
def test_parameter_hooks_fire_as_in_loss_backward(name, deferred):
    """``register_hook`` (doubling the gradient) and ``register_post_accumulate_grad_hook`` on
    the parameters: each fires once per microbatch, on the gradient ``loss.backward()`` gives
    it, whichever path the pass takes (generic split, fast path, first stage, fused BW)."""
    import random

    from tests.helpers import split_oracle as oracle

    make, sample, _ = CASES[name]
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    m = 4
    inputs = []
    for _ in range(m):
        x = sample()
        inputs.append([x.requires_grad_() if x.is_floating_point() else x])
    with torch.no_grad():
        grads = [[torch.randn_like(ref(*[t.detach() for t in x]))] for x in inputs]
    want = oracle.reference(ref, inputs, grads, hooks=oracle.Hooked(ref))
    assert all(want.hooks)  # every microbatch fires some
    for seed in range(2):
        ours.zero_grad(set_to_none=True)
        hooks = oracle.Hooked(ours)
        got = oracle.split(ours, inputs, grads, oracle.pipeline_order(random.Random(seed), m, fuse=0.25), hooks=hooks,
                           deferred_first=deferred)
        for h in hooks.handles:
            h.remove()
        oracle.assert_same(got, want, name)


@pytest.mark.parametrize("name", list(CASES))
def test_a_pass_leaves_nothing_alive_after_its_w(name):
    """Whatever path a pass takes, once W has run and the caller drops what B returned, its
    graph and bookkeeping are gone at once (no reference cycle that only a collection, or
    nothing, would free: such a cycle through an autograd node grew memory step after step)."""
    import weakref

    make, sample, _ = CASES[name]
    torch.manual_seed(0)
    mod = make()
    for _ in range(3):  # the first microbatch checks the signature, the next ones take its path
        x = sample()
        x = x.requires_grad_() if x.is_floating_point() else x
        fp = forward_pass(mod, [x])
        held = (fp, fp.saved, fp.deferral, fp.deferral.anchor if fp.deferral else None, *fp.outputs)
        alive = [weakref.ref(o) for o in held if o is not None]
        g = [torch.randn_like(fp.outputs[0])]
        _, w = backward_input(fp, g)
        backward_weight(w)
        del fp, w, g, held
        assert all(r() is None for r in alive), name
