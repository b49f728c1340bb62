"""What a causal LM's own forward does around its decoder layers, found by running it once.

Why: transformers has some two hundred model types, and each wraps its layers in its own code:
an embedding (scaled or not, with learned positions or none), masks (causal, sliding-window,
per layer type, ALiBi biases), rotary tables (per layer type, partial), and after the layers a
final norm and a head (tied or not, with logit multipliers or soft-capping). Rewriting that glue
per family is where cut models go wrong. Instead a stage runs the model's own forward with its
layer list swapped for slots (``stages``), and this module finds, from one forward of the whole
model on a small batch with hooks, what that needs:

* the layer stack: the outermost ``nn.ModuleList`` whose members the forward calls once each,
  in order (the one with the most parameters if several are);
* that each layer takes the previous one's output as it is (nothing runs between two layers on
  the hidden state) and returns its hidden state as a tensor or a tuple's first item;
* the modules around the stack: those with parameters that run before the first layer (the
  embedding side, which later stages must not run), after the last one (the head side), and
  none with parameters between layers.

Anything else is refused in one line naming what was found.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import ZbError

__all__ = ["Anatomy", "anatomy", "max_positions", "probe_batch", "refuse", "hidden_of"]

# config attributes that bound the sequence length, most specific first
_POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len", "max_sequence_length", "seq_length")


def refuse(model: nn.Module, reason: str) -> ZbError:
    """The one-line error for a model the Hugging Face path cannot cut, naming its type and why."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return ZbError(f"hf_stages: {kind or type(model).__name__} ({type(model).__name__}): {reason}")


def max_positions(config: Any) -> tuple[str, int] | None:
    """The config attribute that bounds the sequence length and its value, if the config has one."""
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key, value
    return None


def hidden_of(out: Any) -> torch.Tensor:
    """A layer's hidden state: the output, or the first item of an output tuple."""
    return out if isinstance(out, torch.Tensor) else out[0]


def probe_batch(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of up to 8 tokens, the second right-padded by 2: ``(input_ids, attention_mask)``."""
    config: Any = model.config
    limit = max_positions(config)
    seq = min(8, limit[1]) if limit else 8
    g = torch.Generator().manual_seed(1234)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise refuse(model, "the config has no vocab_size")
    ids = torch.randint(0, vocab, (2, seq), generator=g).to(device)
    mask = torch.ones(2, seq, dtype=torch.long, device=device)
    mask[1, max(1, seq - 2):] = 0
    return ids, mask


@dataclass
class Anatomy:
    """The parts of a model a stage needs, found by ``anatomy(model)``."""

    model: nn.Module
    parent: nn.Module  # the module whose attribute ``attr`` is the layer list
    attr: str
    path: str  # the layer list's dotted name in the model
    layers: list[nn.Module]
    hidden_names: list[str]  # per layer: the name of its hidden-state parameter
    out_len: list[int]  # per layer: 0 if it returns a tensor, else the length of its tuple
    embeds: bool  # the model's forward takes inputs_embeds
    embed_dim: int  # width of inputs_embeds
    call_kwargs: dict[str, Any]  # keyword arguments every stage passes to the model's forward
    param_modules: list[nn.Module]  # modules outside the layers with parameters of their own
    buffer_modules: list[nn.Module]  # modules outside the layers with buffers and no parameters at all
    buffer_holders: list[nn.Module]  # other modules outside the layers with buffers of their own
    shadowed: list[nn.Module]  # param_modules with a trainable parameter: later stages run them on meta
    names: dict[int, str] = field(default_factory=dict)  # id(module or parameter) -> dotted name
    pre_bare: list[tuple[nn.Module, str]] = field(default_factory=list)  # stage 0's parameters used outside a module call
    ancestors: list[nn.Module] = field(default_factory=list)  # the model down to ``parent``
    reference: torch.Tensor | None = None  # the probe batch's logits, from the whole model

    def passthrough(self, i: int, hidden: torch.Tensor) -> Any:
        """What layer ``i`` would return if it returned ``hidden`` unchanged."""
        n = self.out_len[i]
        return hidden if n == 0 else (hidden,) + (None,) * (n - 1)


def _accepts(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _first_param(module: nn.Module) -> str:
    params = list(inspect.signature(module.forward).parameters.values())
    return params[0].name if params else "hidden_states"


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model's output, whether a ModelOutput or a plain tuple."""
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise ZbError(f"the model returned {type(out).__name__} without logits")
    return logits


def call_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for calling the whole model as a pipeline would: no cache, a dict output."""
    kw: dict[str, Any] = {}
    for name, value in (("use_cache", False), ("return_dict", True)):
        if _accepts(model.forward, name):
            kw[name] = value
    return kw


def anatomy(model: nn.Module) -> Anatomy:
    """Run ``model`` once on ``probe_batch`` (eval mode, no gradient) with hooks, and describe it."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise ZbError(f"hf_stages: {type(model).__name__} is not a transformers model (no config.model_type)")
    for sub in ("vision_config", "audio_config", "encoder_config", "vq_config", "speech_config"):
        if getattr(config, sub, None) is not None:
            raise refuse(model, f"a multimodal model ({sub}); cut its text model instead")
    if not _accepts(model.forward, "attention_mask"):
        raise refuse(model, "its forward takes no attention_mask")
    lists = _outer_lists(model)
    if not lists:
        raise refuse(model, "no nn.ModuleList of layers")
    names = {id(m): n for n, m in model.named_modules()}
    names.update({id(p): n for n, p in model.named_parameters(remove_duplicate=False)})
    in_lists = {id(m) for _, lst in lists for member in lst for m in member.modules()}
    context = [m for m in model.modules() if id(m) not in in_lists and not isinstance(m, nn.ModuleList)]

    events: list[tuple[str, Any]] = []  # ("in"/"out", (list index, member index, tensor)) or ("ctx", module)
    depth = [0]

    def enter(key):
        def hook(module, args, kwargs):
            if depth[0] == 0:
                hidden = args[0] if args else kwargs.get(_first_param(module))
                events.append(("in", (*key, hidden, args, kwargs)))
            depth[0] += 1
        return hook

    def leave(key):
        def hook(module, args, kwargs, out):
            depth[0] -= 1
            if depth[0] == 0:
                events.append(("out", (*key, out)))
        return hook

    def called(module, args):
        if depth[0] == 0:
            events.append(("ctx", module))

    handles = []
    for li, (_, lst) in enumerate(lists):
        for mi, member in enumerate(lst):
            handles.append(member.register_forward_pre_hook(enter((li, mi)), with_kwargs=True))
            handles.append(member.register_forward_hook(leave((li, mi)), with_kwargs=True))
    for m in context:
        if m._parameters or m._buffers:
            handles.append(m.register_forward_pre_hook(called))
    device = _device(model)
    ids, mask = probe_batch(model, device)
    kw = call_kwargs(model)
    flags = {m: m.training for m in model.modules()}
    versions = {n: p._version for n, p in model.named_parameters()}  # bumped by every in-place change
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            reference = logits_of(model(input_ids=ids, attention_mask=mask, **kw))
    except ZbError:
        raise
    except Exception as err:
        raise refuse(model, f"its forward fails on a text batch: {_line(err)}") from None
    finally:
        for m, flag in flags.items():
            m.training = flag
        for h in handles:
            h.remove()

    changed = [n for n, p in model.named_parameters() if p._version != versions.get(n, p._version)]
    if changed:
        raise refuse(model, f"its forward changes its parameters in place ({changed[0]}"
                            f"{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}): a stage cannot repeat that")
    stack = _choose_stack(model, lists, events)
    if stack is None:
        seen = sorted({lists[e[0]][0] for kind, e in events if kind == "in"})
        raise refuse(model, f"no layer list whose layers run once each, in order (lists called: {', '.join(seen) or 'none'})")
    li = stack
    path, layer_list = lists[li]
    ins = [e for kind, e in events if kind == "in" and e[0] == li]
    outs = [e for kind, e in events if kind == "out" and e[0] == li]
    out_len = []
    for (_, mi, out) in outs:
        if isinstance(out, torch.Tensor):
            out_len.append(0)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            out_len.append(len(out))
        else:
            raise refuse(model, f"layer {mi} of {path} returns {type(out).__name__}, not a tensor or a tuple starting with one")
    for i in range(len(ins) - 1):
        if ins[i + 1][2] is not hidden_of(outs[i][2]):
            raise refuse(model, f"the model changes the hidden state between layers {i} and {i + 1} of {path}")
        produced = {id(t) for t in pytree.tree_leaves(outs[i][2]) if isinstance(t, torch.Tensor)}
        produced.discard(id(hidden_of(outs[i][2])))
        args, kwargs = ins[i + 1][3], ins[i + 1][4]
        for key, value in [(f"argument {k + 1}", v) for k, v in enumerate(args[1:])] + list(kwargs.items()):
            if any(id(t) in produced for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)):
                raise refuse(model, f"layer {i + 1} of {path} takes {key} from layer {i}'s output: the layers pass "
                                    "state besides the hidden state")
    # modules with parameters run outside the layers: before the first, after the last, never between
    first_in = events.index(("in", ins[0]))
    last_out = events.index(("out", outs[-1]))
    for pos, (kind, m) in enumerate(events):
        if kind == "ctx" and m._parameters and first_in < pos < last_out:
            raise refuse(model, f"{names.get(id(m), type(m).__name__)} ({type(m).__name__}) runs between layers")
        if kind == "in" and m[0] != li and first_in < pos < last_out:
            raise refuse(model, f"{lists[m[0]][0]} runs between the layers of {path}")

    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    ancestors = [model] + [model.get_submodule(".".join(path.split(".")[: k + 1])) for k in range(path.count("."))]
    layers = list(layer_list)
    embeds = _accepts(model.forward, "inputs_embeds")
    embed_dim = _embed_dim(model, ins[0][2])
    anc = {id(m) for m in ancestors}
    owned = [m for m in context if id(m) not in anc]
    param_modules = [m for m in owned if m._parameters]
    buffer_modules = [m for m in owned if m._buffers and not any(True for _ in m.parameters())]
    holders = [m for m in context if m._buffers and all(m is not b for b in buffer_modules)]
    return Anatomy(
        model=model, parent=parent, attr=attr, path=path, layers=layers,
        hidden_names=[_first_param(layer) for layer in layers], out_len=out_len, embeds=embeds, embed_dim=embed_dim,
        call_kwargs=kw,
        param_modules=param_modules, buffer_modules=buffer_modules, buffer_holders=holders,
        shadowed=[m for m in param_modules if any(p is not None and p.requires_grad for p in m._parameters.values())],
        names=names, ancestors=ancestors, reference=reference,
    )


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _outer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``nn.ModuleList`` of ``model`` not inside another one, with its dotted name."""
    out: list[tuple[str, nn.ModuleList]] = []
    inner: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in inner:
            continue
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            out.append((name, m))
            inner |= {id(x) for x in m.modules() if x is not m}
    return out


def _choose_stack(model: nn.Module, lists, events) -> int | None:
    """The list whose members were each called once at top level, in order; the largest if several."""
    best, size = None, -1
    for li, (_, lst) in enumerate(lists):
        order = [e[1] for kind, e in events if kind == "in" and e[0] == li]
        if order != list(range(len(lst))):
            continue
        n = sum(p.numel() for p in lst.parameters())
        if n > size:
            best, size = li, n
    return best


def _embed_dim(model: nn.Module, first_hidden: torch.Tensor) -> int:
    try:
        emb = model.get_input_embeddings()  # type: ignore[operator]
        weight = getattr(emb, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[1])
    except (AttributeError, NotImplementedError):
        pass
    return int(first_hidden.shape[-1])
