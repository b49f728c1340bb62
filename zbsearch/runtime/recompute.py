"""Checkpointed forwards and recompute passes (R), as the runtime runs them and the profiler times them.

A schedule that holds R(s, j) runs microbatch j's F on stage s checkpointed
(``checkpointed_forward``): the stage runs as usual, with autograd building its graph (so the
outputs it sends on say which need a gradient, as a plain F's do), but every tensor the graph
would save is dropped at once; what the pass keeps is the stage's inputs and the random number
generators' state (CPU, and the device's), counted by the activation meter like saved
activations (a first stage's inputs, which need no gradient, are the step's batch, which the
caller holds anyway: they are not counted). The outputs go on to the next stage (or the loss); the graph dies with them.

R (``recompute``) restores that state, runs the forward again exactly as a plain F would
(``split.forward_pass``: split or not, as the microbatch's backward will run) on the kept
inputs, then puts the generators back where they were: so dropout draws the same masks in R
as in the checkpointed F, and every later pass draws what it would have without recomputation.
On a deterministic device the rebuilt activations, and so the gradients, are bit for bit those
of the same schedule without recomputation. The kept part is let go as R starts, once the
generators hold the state and the forward holds the inputs; what R saves the meter counts,
each storage once (a kept input the graph saves again counts again then): so R never holds more
than it leaves, and after R the rank holds what a plain F would have left.

While a checkpointed forward or a recompute pass runs, ``recompute_mode()`` says which, so that
an emulated stage sleeps the profile's time for it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .errors import PipelineError
from .memory import ActivationMeter, SavedActivations
from .split import ForwardPass, forward_pass

__all__ = ["Checkpoint", "checkpointed_forward", "recompute", "recompute_mode"]

_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("zbsearch_recompute_mode", default=None)


def recompute_mode() -> str | None:
    """"checkpointed" while a checkpointed forward runs, "recompute" during a recompute pass,
    else None."""
    return _MODE.get()


@dataclass(eq=False)
class Checkpoint:
    """What a checkpointed forward keeps for its recompute pass (consumed by it)."""

    inputs: tuple
    cpu_rng: torch.Tensor
    device_rng: tuple[int, torch.Tensor] | None  # (device index, its generator's state)
    kept: SavedActivations
    spent: bool = False


def _drop(t: torch.Tensor) -> None:
    return None


def _gone(_) -> torch.Tensor:
    raise PipelineError("a checkpointed forward's graph was asked for a saved tensor: run its recompute pass (R) first")


def checkpointed_forward(
    module: nn.Module, inputs: Sequence, *, post: Callable | None = None, meter: ActivationMeter | None = None,
    device: torch.device | None = None,
) -> tuple[tuple[torch.Tensor, ...], Checkpoint]:
    """F checkpointed: ``module(*inputs)`` (then ``post``), nothing saved; the outputs and what
    the recompute pass needs (module docstring). ``meter`` counts what is kept."""
    device_rng = None
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device_rng = (index, torch.cuda.get_rng_state(index))
    kept = SavedActivations(meter, module)
    ckpt = Checkpoint(tuple(inputs), torch.get_rng_state(), device_rng, kept)
    # a first stage's inputs (none needs a gradient) are the step's batch, held anyway: not counted
    first = not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    for t in (*(() if first else inputs), ckpt.cpu_rng, *(() if device_rng is None else (device_rng[1],))):
        if isinstance(t, torch.Tensor):
            kept.hold(t)
    token = _MODE.set("checkpointed")
    try:
        with torch.autograd.graph.saved_tensors_hooks(_drop, _gone):
            out = module(*inputs)
            if post is not None:
                out = post(out)
    except BaseException:
        kept.free()
        raise
    finally:
        _MODE.reset(token)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for i, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            kept.free()
            raise PipelineError(f"stage output {i} is a {type(t).__name__}; stages must return a tensor or a tuple of tensors")
    return tuple(outs), ckpt


def recompute(
    ckpt: Checkpoint, module: nn.Module, *, split: bool = True, post: Callable | None = None,
    meter: ActivationMeter | None = None, deferred_first: bool = False,
) -> ForwardPass:
    """R: the checkpointed forward run again as a plain F (``split.forward_pass`` with these
    arguments) from the kept inputs and generator state; the kept part let go."""
    if ckpt.spent:
        raise PipelineError("this checkpointed forward has already been recomputed")
    devices = [] if ckpt.device_rng is None else [ckpt.device_rng[0]]
    inputs = ckpt.inputs
    token = _MODE.set("recompute")
    try:
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ckpt.cpu_rng)
            if ckpt.device_rng is not None:
                torch.cuda.set_rng_state(ckpt.device_rng[1], ckpt.device_rng[0])
            # consumed before the forward runs: the generators hold the state now, and the inputs
            # count again where the forward saves them, so the pass never holds both
            ckpt.kept.free()
            ckpt.spent = True
            ckpt.inputs = ()
            fp = forward_pass(module, inputs, split=split, post=post, meter=meter, deferred_first=deferred_first)
    finally:
        _MODE.reset(token)
    return fp
