"""Selective recomputation: a forward that drops what chosen modules save, and the RS pass that
rebuilds it before the backward.

A stage declares the modules worth recomputing by giving them a ``selective_recompute``
attribute naming the mode they belong to (``zbsearch.formats.profile.SELECTIVE_MODES``):
``"attention"`` for a layer's attention core (QK^T, softmax, dropout, the weighted sum of V:
Megatron's selective recomputation, which keeps the projections' activations and drops the
attention probabilities, seq x seq per head), ``"mlp"`` for a layer's MLP; ``True`` puts a
module in every mode. A model may declare both; one mode runs: the one the schedule's profile
measured (its ``selective``), so that what RS rebuilds is what the costs describe. A module
inside a selected one is part of it.

A schedule that holds RS(s, j) runs microbatch j's F on stage s as a plain F (``split.forward_pass``,
split or fused as its backward will run, the same deferral), except that while a selected module
runs, the activations it saves, for B or for W, are not kept: an empty holder stands for each
(``SavedActivations.diverted``). What the selected module needs to run again is kept instead,
counted by the activation meter like saved activations: its inputs (which the rest of the graph
often saves anyway, then counted once) and, if it drew random numbers (dropout), the generators'
state at its call. RS (``recompute_selected``) re-runs each recorded call in order, on the kept
inputs, with the generators put back to where they were at that call, under the same hooks and the
same deferral as the forward, so that what the calls save fills the holders in the same order
(``SavedActivations.refilled``, which checks shapes and count); each call's kept part is let go as
the call starts (its inputs count again where the call saves them), so that RS never holds more
than it leaves; then it puts the generators back as they were before RS. Dropout draws the same
masks as in the forward, every later pass draws what it would have without recomputation, and on
a deterministic device the gradients are bit for bit those of the same schedule without
recomputation. After RS the rank holds what a plain F would have left.

A tensor a selected module saves that lives in one of its inputs or outputs (a Linear's input,
an activation function's output) is kept, not dropped: it stays alive anyway, and recomputing it
would only make a copy. A selected module must run the same way on the same inputs and leave its
inputs unchanged (an in-place change to one is refused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..formats.profile import SELECTIVE_MODES
from .errors import PipelineError
from .memory import ActivationMeter, SavedActivations, storages

__all__ = ["Selection", "recompute_selected", "selected_modules", "SELECT_ATTRIBUTE"]

SELECT_ATTRIBUTE = "selective_recompute"


def selected_modules(stage: nn.Module, mode: str | None) -> list[nn.Module]:
    """The modules of ``stage`` (itself included) that declare ``selective_recompute`` as
    ``mode`` or as True (every mode), outermost only, in the order ``named_modules`` gives them
    (``mode`` None: those declared True only). A value other than a mode or a bool is refused."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in stage.named_modules():
        value = getattr(m, SELECT_ATTRIBUTE, False)
        if not isinstance(value, bool) and value not in SELECTIVE_MODES:
            raise PipelineError(f"{type(m).__name__} declares {SELECT_ATTRIBUTE} = {value!r}: give a mode "
                                f"({', '.join(map(repr, SELECTIVE_MODES))}) or True (every mode)")
        if any(not outer or name.startswith(outer + ".") for outer, _ in chosen):
            continue
        if value is True or (mode is not None and value == mode):
            chosen.append((name, m))
    return [m for _, m in chosen]


@dataclass(eq=False)
class _Call:
    """One call of a selected module during the forward, as RS runs it again."""

    module: nn.Module
    spec: TreeSpec
    leaves: list  # its arguments flattened: kept handles for tensors, other values as they are
    grads: list[bool | None]  # per leaf: whether the tensor required a gradient (None: no tensor)
    rng: tuple | None  # kept handles of the generators' state at the call (CPU, device), if it drew


class Selection:
    """The selected modules' calls of one selectively checkpointed forward: what RS needs.

    Pass it to ``forward_pass(select=...)``, which runs the forward with the selected modules'
    saves diverted (``recording``) and sets ``mode``: the context the forward ran the stage
    under (the split's deferral), in which RS runs the calls again. ``meter`` counts what is kept.
    """

    def __init__(self, stage: nn.Module, modules: list[nn.Module], meter: ActivationMeter | None = None,
                 device: torch.device | None = None) -> None:
        if not modules:
            raise PipelineError("selective recomputation needs at least one module declared with selective_recompute")
        self.modules = modules
        self.kept = SavedActivations(meter, stage)
        self.kept.hooks()  # only to learn the stage's parameters: they are referenced, not counted
        self.holders: list = []  # the empty holders, in the order the forward saved them
        self.calls: list[_Call] = []
        self.mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.cuda = device.index if device is not None and device.type == "cuda" else None
        if device is not None and device.type == "cuda" and self.cuda is None:
            self.cuda = torch.cuda.current_device()
        self.spent = False

    def _rng(self) -> tuple:
        cpu = torch.get_rng_state()
        return (cpu,) if self.cuda is None else (cpu, torch.cuda.get_rng_state(self.cuda))

    @contextlib.contextmanager
    def recording(self, saved: SavedActivations) -> Iterator[None]:
        """The forward's context: each outermost call of a selected module is recorded, and
        what it saves in ``saved`` diverted to empty holders."""
        depth = 0
        divert = saved.diverted(self.holders)
        state: dict = {}

        def pre(module, args, kwargs):
            nonlocal depth
            depth += 1
            if depth == 1:
                leaves, spec = tree_flatten((args, kwargs))
                tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
                state.update(module=module, leaves=leaves, spec=spec, versions=[t._version for t in tensors],
                             rng=self._rng(), start=len(self.holders))
                divert.__enter__()

        def post(module, args, kwargs, output):
            nonlocal depth
            depth -= 1
            if depth == 0:
                divert.__exit__(None, None, None)
                ends = [x for x in (*state["leaves"], *tree_flatten(output)[0]) if isinstance(x, torch.Tensor)]
                saved.settle(self.holders[state["start"]:], {s.data_ptr() for t in ends for s in storages(t)})
                self._record(state)

        handles = []
        try:
            for m in self.modules:
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(m.register_forward_hook(post, with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()
            if depth:
                divert.__exit__(None, None, None)

    def _record(self, state: dict) -> None:
        leaves = state["leaves"]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if [t._version for t in tensors] != state["versions"]:
            name = type(state["module"]).__name__
            raise PipelineError(f"the selected module {name} changed one of its inputs in place: it cannot be recomputed")
        before, after = state["rng"], self._rng()
        drew = any(not torch.equal(a, b) for a, b in zip(before, after))
        self.calls.append(_Call(
            state["module"], state["spec"],
            [self.kept.hold(x) if isinstance(x, torch.Tensor) else x for x in leaves],
            [x.requires_grad if isinstance(x, torch.Tensor) else None for x in leaves],
            tuple(self.kept.hold(t) for t in before) if drew else None,
        ))
        state.clear()


def recompute_selected(select: Selection, saved: SavedActivations) -> None:
    """RS: run the selected modules' recorded calls again, so that what they save fills the
    forward's empty holders in ``saved`` (the forward pass's ``saved``); the kept part let go."""
    if select.spent:
        raise PipelineError("this selectively checkpointed forward has already been recomputed (RS)")
    devices = [] if select.cuda is None else [select.cuda]
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), saved.refilled(select.holders), \
            saved.hooks(), select.mode():
        for call in select.calls:
            if call.rng is not None:
                torch.set_rng_state(select.kept.read(call.rng[0]))
                if select.cuda is not None:
                    torch.cuda.set_rng_state(select.kept.read(call.rng[1]), select.cuda)
            leaves = [x if g is None else _input(select.kept.read(x), g) for x, g in zip(call.leaves, call.grads)]
            # what this call kept is consumed: let it go before the call saves anew, so that RS
            # never holds both (a kept input the call saves again is counted once either way)
            select.kept.release([*(x for x, g in zip(call.leaves, call.grads) if g is not None), *(call.rng or ())])
            args, kwargs = tree_unflatten(leaves, call.spec)
            call.module(*args, **kwargs)
    select.kept.free()
    select.spent = True
    select.calls = []
    select.holders = []


def _input(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """A kept input as the recorded call saw it: the same values, needing a gradient as it did
    (so that the same operations save the same tensors), in a graph of its own."""
    if isinstance(t, nn.Parameter):  # a stage parameter passed in: the parameter itself
        return t
    x = t.detach()
    return x.requires_grad_(grad) if grad and (x.is_floating_point() or x.is_complex()) else x
