"""A causal LM cut into pipeline stages that run the model's own forward.

A stage holds layers ``[lo, hi)`` of the stack ``anatomy`` found. It runs the whole model's
``forward`` with the layer list swapped for slots: the model builds its masks, rotary tables,
position biases and embedding exactly as when unsplit, and the slots run only the stage's
layers:

* stage 0 runs the forward from ``input_ids``; its slots hand the hidden state to its layers
  and stop the forward after its last layer;
* a later stage runs the forward from a zero ``inputs_embeds`` of the right shape: modules with
  trainable parameters before the layers (the embedding side, stage 0's) run on the meta
  device, and stage 0's parameters used outside a module call are zeros there, so nothing is
  computed with another stage's weights or on another stage's device (modules whose parameters
  are all frozen, such as a fixed position table feeding the layers, run for real and every
  stage holds them); the slot of its first layer swaps in the hidden state received, and the
  last stage lets the forward go on through the final norm, the head and whatever the model
  does to its logits.

Every boundary is ``(hidden, attention_mask)``, plus ``position_ids`` when stage 0 was given
them (without, each stage lets the model derive them from the mask as it would unsplit).

``hf_stages`` checks the cut on a small batch before returning it: the stages' logits must
equal the whole model's bit for bit, and every parameter the stages reach must belong to one
(or, if several reach it, be declared tied). Which modules a stage holds comes from that run:
those it called for real and, found on the autograd graph, parameters used without a module
call. Layers ``[lo, hi)`` are held whole (an expert no probe token chose still belongs there).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import ZbError
from ...formats.profile import SELECTIVE_MODES
from ...runtime.selective import SELECT_ATTRIBUTE
from .anatomy import Anatomy, anatomy, hidden_of, logits_of, max_positions, probe_batch, refuse
from .attention import declare_cores

__all__ = ["HFStages", "HFStage", "hf_stages"]


@dataclass
class HFStages:
    """The stages of one model, the tie declaration for the runtime, and the layers per stage."""

    stages: list[nn.Module]
    tied: list[tuple[str, ...]] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)  # decoder layers per stage
    layer_list: str = ""  # the model's layer list, e.g. "model.layers"


class _Stop(Exception):
    """Raised by the slot after a stage's last layer: ends the model's forward there."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _Slot(nn.Module):
    """Stands for layer ``i`` in the model's layer list while a stage runs; attributes the
    model's forward reads (``attention_type``, ``is_sliding``, ...) come from the layer."""

    def __init__(self, i: int, layer: nn.Module, harness: _Harness) -> None:
        super().__init__()
        self.__dict__["_zb"] = (i, layer, harness)  # not registered: the layer stays the model's

    def forward(self, *args, **kwargs):
        i, layer, harness = self.__dict__["_zb"]
        return harness.current.layer(i, layer, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_zb"][1], name)


class _Harness:
    """The slots of one model and the pass running now (stages of one model share it)."""

    def __init__(self, a: Anatomy) -> None:
        self.a = a
        self.slots = nn.ModuleList([_Slot(i, layer, self) for i, layer in enumerate(a.layers)])
        self.current: Any = None

    @contextlib.contextmanager
    def running(self, p: _Pass):
        a = self.a
        original = a.parent._modules[a.attr]
        for slot, layer in zip(self.slots, a.layers):  # a forward that reads layer.training reads the layer's
            slot.training = layer.training
        a.parent._modules[a.attr] = self.slots
        shadowed, swapped = [], []
        if not p.runner.first:
            for m in a.shadowed:
                had = m.__dict__.get("forward")
                m.__dict__["forward"] = _shadow(self, m, m.forward)
                shadowed.append((m, had))
            assert p.h_in is not None
            for m, name in a.pre_bare:  # stage 0's parameters used by the forward outside a module call
                t = m._parameters[name]
                assert t is not None
                swapped.append((m, name, t))
                m._parameters[name] = torch.zeros(t.shape, dtype=t.dtype, device=p.h_in.device)  # type: ignore[assignment]
        prev, self.current = self.current, p
        try:
            yield
        finally:
            self.current = prev
            for m, name, t in swapped:
                m._parameters[name] = t
            for m, had in shadowed:
                if had is None:
                    del m.__dict__["forward"]
                else:
                    m.__dict__["forward"] = had
            a.parent._modules[a.attr] = original


def _shadow(harness: _Harness, module: nn.Module, original):
    """``module.forward`` for a later stage: before the first layer, run on the meta device and
    answer zeros of the same shapes (on the stage's device, with no gradient)."""

    def forward(*args, **kwargs):
        p = harness.current
        if p is None or p.phase != "pre" or p.meta:
            return original(*args, **kwargs)
        device = p.h_in.device
        p.meta = True
        try:
            with torch.no_grad():
                state = {n: t.detach().to("meta") for n, t in itertools.chain(
                    module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))}
                meta_args, meta_kwargs = pytree.tree_map(_to_meta, (args, kwargs))
                out = torch.func.functional_call(module, state, tuple(meta_args), dict(meta_kwargs), strict=False)
            return pytree.tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                                   if isinstance(t, torch.Tensor) else t, out)
        except Exception:
            with torch.no_grad():  # a module the meta device cannot run: run it, unused, without a graph
                p.meta = False
                return original(*args, **kwargs)
        finally:
            p.meta = False

    return forward


def _to_meta(t):
    return t.detach().to("meta") if isinstance(t, torch.Tensor) else t


class _Pass:
    """One stage forward: where it is (before, in or after its layers) and what it received."""

    def __init__(self, runner: _Runner, h_in: torch.Tensor | None, probe: _Probe | None) -> None:
        self.runner, self.h_in, self.probe = runner, h_in, probe
        self.phase = "pre"
        self.meta = False

    def layer(self, i: int, layer: nn.Module, args: tuple, kwargs: dict):
        r, a = self.runner, self.runner.a
        name = a.hidden_names[i]
        if i < r.lo:
            hidden = args[0] if args else kwargs[name]
            if i == len(a.layers) - 1:  # a last stage without layers: its input goes to the head
                assert self.h_in is not None
                self.phase = "post"
                return a.passthrough(i, self.h_in)
            return a.passthrough(i, hidden)
        if i == r.lo:
            if not r.first:
                args, kwargs = ((self.h_in,) + args[1:], kwargs) if args else (args, {**kwargs, name: self.h_in})
            elif r.hi == r.lo:  # a first stage without layers
                raise _Stop(args[0] if args else kwargs[name])
            self.phase = "loop"
        if self.probe is not None:
            self.probe.check_inputs(i, args, kwargs)
        out = layer(*args, **kwargs)
        if i == r.hi - 1:
            if not r.last:
                raise _Stop(hidden_of(out))
            self.phase = "post"
        return out


class _Runner:
    """Runs stage ``index`` (layers ``[lo, hi)``) through the model's forward."""

    def __init__(self, a: Anatomy, harness: _Harness, index: int, lo: int, hi: int, num_stages: int) -> None:
        self.a, self.harness = a, harness
        self.index, self.lo, self.hi = index, lo, hi
        self.first, self.last = index == 0, index == num_stages - 1
        self.limit = max_positions(a.model.config)

    def __call__(self, *args, probe: _Probe | None = None):
        a = self.a
        if len(args) not in (2, 3) or not all(isinstance(t, torch.Tensor) for t in args):
            what = "(input_ids, attention_mask[, position_ids])" if self.first else "(hidden, attention_mask[, position_ids])"
            raise ZbError(f"hf stage {self.index} takes {what}, got {len(args)} arguments")
        mask = args[1]
        pos = args[2] if len(args) == 3 else None
        inputs: dict[str, Any] = {}
        if self.first:
            ids = args[0]
            if self.limit is not None and ids.shape[-1] > self.limit[1]:
                key, value = self.limit
                raise ZbError(f"sequence length {ids.shape[-1]} exceeds the model's {key} = {value}")
            h_in = None
            inputs["input_ids"] = ids
        else:
            h_in = args[0]
            if self.lo == self.hi and not self.last:
                return tuple(args)
            b, s = h_in.shape[:2]
            if a.embeds:
                inputs["inputs_embeds"] = torch.zeros(b, s, a.embed_dim, dtype=h_in.dtype, device=h_in.device)
            else:
                inputs["input_ids"] = torch.zeros(b, s, dtype=torch.long, device=h_in.device)
        if pos is not None:
            inputs["position_ids"] = pos
        p = _Pass(self, h_in, probe)
        with self.harness.running(p):
            try:
                out = a.model(attention_mask=mask, **inputs, **a.call_kwargs)
            except _Stop as stop:
                hidden = stop.hidden
            else:
                if not self.last or p.phase != "post":
                    raise ZbError(f"hf stage {self.index}: the model's forward did not run layers {self.lo}-{self.hi - 1}")
                return logits_of(out)
        return (hidden, mask) if pos is None else (hidden, mask, pos)


class HFStage(nn.Module):
    """One stage: the model's own modules it runs (its layers as ``layers``, and the embedding
    side on the first stage, the head side on the last), and the forward that runs them."""

    def __init__(self, runner: _Runner, pre: list[tuple[str, nn.Module]], post: list[tuple[str, nn.Module]],
                 bare: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        for name, m in pre:
            self.add_module(name, m)
        self.layers = nn.ModuleList(runner.a.layers[runner.lo:runner.hi])
        for name, m in post:
            self.add_module(name, m)
        for name, p in bare:
            self.register_parameter(name, p)
        self.__dict__["_runner"] = runner
        self.first, self.last = runner.first, runner.last

    def forward(self, *args):
        """Run this stage's part of the model on what the previous stage handed on."""
        return self.__dict__["_runner"](*args)

    @property
    def hf_model(self) -> nn.Module:
        """The whole model this stage is a part of (its config, its class's plans)."""
        return self.__dict__["_runner"].a.model

    def _apply(self, fn, recurse=True):
        # the buffers of the model's modules this stage runs without holding them (holders of
        # parameters of other stages, the model itself) move with it
        super()._apply(fn, recurse)
        for m in self.__dict__["_runner"].a.buffer_holders:
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = fn(buf)
        return self

    def extra_repr(self) -> str:
        """Which layers of which model this stage runs."""
        r = self.__dict__["_runner"]
        return f"stage {r.index}: layers {r.lo}-{r.hi - 1} of {r.a.path}" if r.hi > r.lo else f"stage {r.index}: no layer"


class _Probe:
    """Records, during one stage's probe forward, the modules it runs for real (outside its
    layers) and refuses layer inputs computed from parameters."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        self.called: list[tuple[nn.Module, str]] = []
        self.handles: list[Any] = []
        params = {id(m) for m in runner.a.shadowed}
        seen: set[int] = set()

        def hook(module, args):
            p = runner.harness.current
            if p is None or p.meta or id(module) in seen:
                return
            if not runner.first and p.phase == "pre" and id(module) in params:
                return  # shadowed: run on the meta device, not this stage's
            seen.add(id(module))
            self.called.append((module, p.phase))

        for m in runner.a.param_modules + runner.a.buffer_modules:
            self.handles.append(m.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def check_inputs(self, i: int, args: tuple, kwargs: dict) -> None:
        named = [(f"argument {k + 1}", v) for k, v in enumerate(args[1:])] + list(kwargs.items())
        for key, value in named:
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    raise refuse(self.runner.a.model, f"layer {i} takes {key}, computed from parameters outside the "
                                                      "layers (a stage cannot receive it)")


def _graph_params(outputs) -> list[nn.Parameter]:
    """Parameters an output's autograd graph reaches (found at its AccumulateGrad nodes)."""
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    found: dict[int, nn.Parameter] = {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, nn.Parameter):
            found.setdefault(id(var), var)
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return list(found.values())


def _layers_per_stage(n: int, num_stages: int, layers_per_stage: list[int] | None) -> list[int]:
    if num_stages < 2:
        raise ZbError(f"hf_stages: a pipeline needs at least 2 stages, not {num_stages}")
    if layers_per_stage is None:
        if n < num_stages:
            raise ZbError(f"hf_stages: {n} layers cannot fill {num_stages} stages; give layers_per_stage "
                          "(--layers-per-stage on the command line)")
        q, r = divmod(n, num_stages)
        return [q + (s < r) for s in range(num_stages)]
    counts = list(layers_per_stage)
    if len(counts) != num_stages or sum(counts) != n or min(counts) < 0:
        raise ZbError(f"hf_stages: layers_per_stage {counts} must be {num_stages} counts adding up to the {n} layers")
    return counts


# where a decoder layer keeps its MLP (or mixture of experts), by family
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")


def _declare_selective(layers: list[nn.Module], modes: Sequence[str]) -> list[nn.Module]:
    """Declare every decoder layer's modules of each mode for selective recomputation (its
    attention core, ``attention``; its MLP); the attention cores declared."""
    cores: list[nn.Module] = []
    for mode in modes:
        if mode not in SELECTIVE_MODES:
            raise ZbError(f"selective recomputation: unknown mode {mode!r}; choose {', '.join(SELECTIVE_MODES)}")
        if mode == "attention":
            cores += declare_cores(layers)
            continue
        for i, layer in enumerate(layers):
            module = next((getattr(layer, n) for n in _MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
            if module is None:
                children = ", ".join(n for n, _ in layer.named_children())
                raise ZbError(f"selective recomputation of the MLP: layer {i} ({type(layer).__name__}) has no module "
                              f"named {' or '.join(_MLP_NAMES)}; its modules: {children}")
            setattr(module, SELECT_ATTRIBUTE, mode)
    return cores


def hf_stages(model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None,
              selective: str | Sequence[str] = ()) -> HFStages:
    """Cut a ``*ForCausalLM`` into ``num_stages`` stages (2P for V or interleaved placement).

    Layers are shared out evenly (earlier stages take the remainder) unless
    ``layers_per_stage`` says otherwise; a stage may hold no layer (e.g. only the embedding).
    The cut is run once on a small batch and refused in one line (``ZbError``) unless its
    logits equal the model's bit for bit. The stages share the model's modules.
    ``selective``: modes of selective recomputation (``zbsearch.runtime.selective``) to declare
    each decoder layer's modules for: ``"attention"``, its attention core (``hf.attention``),
    ``"mlp"``, its MLP; a layer without them is refused.
    """
    a = anatomy(model)
    counts = _layers_per_stage(len(a.layers), num_stages, layers_per_stage)
    cores = _declare_selective(a.layers, [selective] if isinstance(selective, str) else selective)
    harness = _Harness(a)
    runners, lo = [], 0
    for s, k in enumerate(counts):
        runners.append(_Runner(a, harness, s, lo, lo + k, num_stages))
        lo += k
    called: set[int] = set()
    handles = [c.register_forward_pre_hook(lambda m, args: called.add(id(m))) for c in cores]
    try:
        stages = _probe_and_build(a, runners)
    finally:
        for h in handles:
            h.remove()
    if any(id(c) not in called for c in cores):
        raise refuse(model, "its attention modules do not run their core through transformers' attention functions, so "
                            "the core cannot be recomputed selectively (use the mode mlp)")
    return HFStages(stages, _ties(stages), counts, a.path)


def _probe_and_build(a: Anatomy, runners: list[_Runner]) -> list[nn.Module]:
    model = a.model
    device = a.reference.device if a.reference is not None else torch.device("cpu")
    ids, mask = probe_batch(model, device)
    flags = {m: m.training for m in model.modules()}
    model.eval()
    found: list[tuple[list[tuple[nn.Module, str]], list[nn.Parameter]]] = []
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            x: tuple = (ids, mask)
            out: Any = None
            for r in runners:
                probe = _Probe(r)
                try:
                    out = r(*x, probe=probe)
                except ZbError:
                    raise
                except Exception as err:
                    raise refuse(model, f"stage {r.index} fails: {type(err).__name__}: {_line(err)}") from None
                finally:
                    probe.remove()
                outs = out if isinstance(out, tuple) else (out,)
                found.append((probe.called, _graph_params(outs)))
                if r.first:
                    a.pre_bare = _bare_places(a, found[0][1], r)
                x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
    finally:
        for m, flag in flags.items():
            m.training = flag
    logits = out
    ref = a.reference
    if ref is not None and ref.device.type != "meta":
        valid = mask.bool()
        got = logits.detach()
        if got.shape != ref.shape:
            raise refuse(model, f"the stages' logits have shape {tuple(got.shape)}, the model's {tuple(ref.shape)}")
        if not torch.equal(got[valid], ref[valid]):
            what = f"differ by up to {(got[valid].float() - ref[valid].float()).abs().max().item():.3g}"
            raise refuse(model, f"the stages' logits {what} from the model's (its forward does something a stage cannot repeat)")
    return [_build(a, r, called, params) for r, (called, params) in zip(runners, found)]


def _bare_places(a: Anatomy, params: list[nn.Parameter], first: _Runner) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of the first stage's parameters used outside a module call."""
    inside = {id(p) for layer in a.layers[first.lo:first.hi] for p in layer.parameters()}
    inside |= {id(p) for m in a.param_modules for p in m._parameters.values() if p is not None}
    out = []
    for p in params:
        if id(p) in inside or id(p) not in a.names:
            continue
        owner, _, attr = a.names[id(p)].rpartition(".")
        out.append((a.model.get_submodule(owner), attr))
    return out


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _build(a: Anatomy, r: _Runner, called: list[tuple[nn.Module, str]], params: list[nn.Parameter]) -> HFStage:
    taken = {"layers"}

    def name_of(obj) -> str:
        path = a.names.get(id(obj), f"part{len(taken)}")
        short = path.rpartition(".")[2]
        name = short if short not in taken and not short.isdigit() else path.replace(".", "_")
        taken.add(name)
        return name

    modules = [m for m, _ in called]
    inside = {id(x) for m in modules for x in m.modules() if x is not m}
    pre = [(name_of(m), m) for m, phase in called if phase == "pre" and id(m) not in inside]
    post = [(name_of(m), m) for m, phase in called if phase != "pre" and id(m) not in inside]
    held = {id(p) for layer in a.layers[r.lo:r.hi] for p in layer.parameters()}
    held |= {id(p) for m in modules for p in m.parameters()}
    layer_params = {id(p) for layer in a.layers for p in layer.parameters()}
    bare = []
    for p in params:
        if id(p) in held:
            continue
        if id(p) in layer_params:
            raise refuse(a.model, f"stage {r.index} uses {a.names.get(id(p), 'a parameter')} of another stage's layer")
        bare.append((name_of(p), p))
    return HFStage(r, pre, post, bare)


def _ties(stages: list[nn.Module]) -> list[tuple[str, ...]]:
    """Parameters held by more than one stage, as ``PipelineRuntime(tied=...)`` groups."""
    where: dict[int, list[str]] = {}
    for s, st in enumerate(stages):
        for name, p in st.named_parameters():
            where.setdefault(id(p), []).append(f"{s}.{name}")
    params = {id(p): p for st in stages for p in st.parameters()}
    return [tuple(names) for key, names in where.items()
            if len({n.partition(".")[0] for n in names}) > 1 and params[key].requires_grad]
