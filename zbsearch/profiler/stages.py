"""The model to profile: a user's build function or the built-in GPT, checked before timing.

A user's model is named by an import path, ``package.module:function``. The function takes
keyword arguments given on the command line (``--model-arg layers=8``, ``parse_model_args``:
ints, floats and true/false are converted, anything else stays a string) and returns
``(stages, microbatch)`` or ``(stages, microbatch, loss_fn, target)``:
``stages`` a list of ``nn.Module`` (stage s takes stage s-1's outputs as positional
arguments), ``microbatch`` what stage 0 takes (a tensor or a tuple of tensors). With a loss,
the last stage's F includes ``loss_fn(output, target)`` and its B starts from the loss, as in
the runtime; without, its B starts from a gradient shaped like its output.

Everything that can go wrong with such a function is reported in one line before anything is
timed: the import, the call, what it returned, and stages whose outputs the next stage cannot
take.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ZbError
from ..models.gpt import GPTConfig, gpt_batch, gpt_loss, gpt_stages
from ..models.moe import ExpertGroups, MoEConfig, moe_stages
from ..runtime.memory import own_storage

__all__ = [
    "ModelSpec",
    "load_model",
    "parse_model_args",
    "as_model",
    "builtin_gpt",
    "builtin_moe",
    "as_inputs",
    "run_stage",
    "describe",
    "leaves",
]

_CONTRACT = "(stages, microbatch) or (stages, microbatch, loss_fn, target)"


@dataclass
class ModelSpec:
    """A model to profile: its stages, an example microbatch and, optionally, the loss.

    ``stages[s]`` takes stage s-1's outputs (stage 0: ``microbatch``); ``loss_fn(output, target)``
    runs after the last stage's forward, as in the runtime.
    """

    name: str
    stages: list[nn.Module]
    microbatch: tuple
    loss_fn: Callable | None = None
    target: Any = None
    settings: dict = field(default_factory=dict)  # recorded in the profile (model size, source)

    def __post_init__(self) -> None:
        # a microbatch sliced from a larger batch gets its own storage, as the runtime gives each
        # microbatch: a stage saving its token ids or labels is charged one microbatch's bytes
        self.microbatch = tuple(own_storage(t) if isinstance(t, torch.Tensor) else t for t in self.microbatch)
        if isinstance(self.target, torch.Tensor):
            self.target = own_storage(self.target)
        elif isinstance(self.target, tuple):
            self.target = tuple(own_storage(t) if isinstance(t, torch.Tensor) else t for t in self.target)

    def post(self, stage: int) -> Callable | None:
        """What the runtime applies after the stage's forward: the loss, on the last stage."""
        loss_fn = self.loss_fn
        if stage != len(self.stages) - 1 or loss_fn is None:
            return None
        return lambda out: loss_fn(out, self.target)

    def to(self, device: torch.device, dtype: torch.dtype | None, only: Collection[int] | None = None) -> None:
        """Move the stages (or the stages ``only``, a rank's under torchrun), the microbatch and the target."""
        for s, st in enumerate(self.stages):
            if only is None or s in only:
                self.stages[s] = st.to(device=device, dtype=dtype) if dtype is not None else st.to(device)
        self.microbatch = tuple(_move(t, device, dtype) for t in self.microbatch)
        self.target = _move(self.target, device, dtype)


def _move(t, device, dtype):
    if not isinstance(t, torch.Tensor):
        return t
    return t.to(device=device, dtype=dtype) if dtype is not None and t.is_floating_point() else t.to(device)


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """``["layers=8", "lr=0.1", "tie=true", "name=x"]`` -> keyword arguments, values typed."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ZbError(f"--model-arg {item!r}: expected key=value with a Python name as key")
        if key in out:
            raise ZbError(f"--model-arg {key!r} given twice")
        out[key] = _typed(text)
    return out


def _typed(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def load_model(path: str, kwargs: dict[str, Any] | None = None) -> ModelSpec:
    """Import ``package.module:function``, call it with ``kwargs``, and check what it returned."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ZbError(f"--model {path!r}: expected an import path like mypkg.model:build_stages")
    if os.getcwd() not in sys.path:  # as with ``python -m``: a module in the current folder imports
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or any error raised while the module runs
        raise ZbError(f"--model {path!r}: cannot import {module_name!r}: {_first_line(err)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ZbError(f"--model {path!r}: module {module_name!r} has no function {attr!r}")
    kwargs = dict(kwargs or {})
    call = f"{attr}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    try:
        result = fn(**kwargs)
    except Exception as err:
        raise ZbError(f"--model {path!r}: {call} raised {_first_line(err)}") from None
    spec = as_model(result, f"--model {path!r}: {call}")
    spec.name, spec.settings = attr, {"model": path, **({"args": kwargs} if kwargs else {})}
    return spec


def as_model(result: object, where: str) -> ModelSpec:
    """Check a build function's result against the contract (``where`` names it in errors)."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 4):
        raise ZbError(f"{where} returned {_kind(result)}; expected {_CONTRACT}")
    stages, microbatch, *loss = result
    if not isinstance(stages, Sequence) or not stages or not all(isinstance(s, nn.Module) for s in stages):
        raise ZbError(f"{where}: stages must be a non-empty list of torch.nn.Module, got {_kind(stages)}")
    inputs = as_inputs(microbatch)
    if inputs is None:
        raise ZbError(f"{where}: the microbatch must be a tensor or a tuple of tensors, got {_kind(microbatch)}")
    loss_fn, target = loss if loss else (None, None)
    if loss and not callable(loss_fn):
        raise ZbError(f"{where}: loss_fn must be callable, got {_kind(loss_fn)}")
    return ModelSpec("model", list(stages), inputs, loss_fn, target)


def builtin_gpt(cfg: GPTConfig) -> ModelSpec:
    """The built-in GPT of ``cfg`` with one microbatch of its synthetic data and its loss."""
    ids, targets = gpt_batch(cfg)
    name = f"gpt-l{cfg.layers}-h{cfg.hidden}-s{cfg.seq}-b{cfg.microbatch_size}-p{cfg.stages}"
    return ModelSpec(name, gpt_stages(cfg), (ids,), gpt_loss, targets, {"model": "builtin gpt", **asdict(cfg)})


def builtin_moe(cfg: MoEConfig, groups: ExpertGroups | None = None) -> ModelSpec:
    """The built-in GPT with experts (``models.moe``) of ``cfg``, its experts sharded over
    ``groups`` if given, with one microbatch of its synthetic data and its loss."""
    ids, targets = gpt_batch(cfg)
    name = (f"moe-l{cfg.layers}-h{cfg.hidden}-e{cfg.experts}k{cfg.top_k}-s{cfg.seq}-b{cfg.microbatch_size}"
            f"-p{cfg.stages}")
    return ModelSpec(name, moe_stages(cfg, groups=groups), (ids,), gpt_loss, targets, {"model": "builtin moe", **asdict(cfg)})


def as_inputs(value: object) -> tuple | None:
    """A stage's positional inputs as a tuple of tensors, or None if it is not one."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return items if items and all(isinstance(t, torch.Tensor) for t in items) else None


def leaves(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A stage's inputs as the runtime hands them over: detached, needing a gradient where the
    previous stage's output did."""
    return tuple(t.detach().requires_grad_(t.requires_grad and t.is_floating_point()) for t in tensors)


def describe(tensors: Sequence[torch.Tensor]) -> str:
    """Dtypes and shapes of ``tensors`` for a message, e.g. ``float32(4, 128, 256)``."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}" for t in tensors)


def stage_inputs(spec: ModelSpec) -> list[tuple[torch.Tensor, ...]]:
    """Each stage's inputs as the runtime hands them over (``leaves``): the microbatch, then each
    stage's real outputs, from one forward of every stage in turn (autograd on)."""
    inputs, x = [], spec.microbatch
    with torch.enable_grad():
        for s in range(len(spec.stages)):
            inputs.append(leaves(x))
            x = run_stage(spec, s, inputs[-1])
    return inputs


def run_stage(spec: ModelSpec, stage: int, inputs: tuple) -> tuple[torch.Tensor, ...]:
    """One forward of a stage, with autograd on (its outputs say which need a gradient); a stage
    that cannot take its inputs, or returns something else than tensors, is a one-line error."""
    source = "the example microbatch" if stage == 0 else f"the outputs of stage {stage - 1}"
    try:
        out = spec.stages[stage](*inputs)
    except Exception as err:
        raise ZbError(f"stage {stage} does not accept {source} ({describe(inputs)}): {_first_line(err)}") from None
    outs = as_inputs(out)
    if outs is None:
        raise ZbError(f"stage {stage} returned {_kind(out)}; stages must return a tensor or a tuple of tensors")
    post = spec.post(stage)
    if post is not None:
        try:
            loss = post(out)
        except Exception as err:
            raise ZbError(
                f"loss_fn does not accept the outputs of the last stage ({describe(outs)}): {_first_line(err)}"
            ) from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ZbError(f"loss_fn must return a scalar tensor, got {_kind(loss)}")
    return outs


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"
