"""Replay zbsearch schedules in torch.distributed, with the backward split into B and W.

Names load on first use, so importing the package costs nothing until a name is used.

=====================  ==============================================================
``PipelineRuntime``    one rank's replay of a schedule (``runtime``)
``PipelineError``      a step that cannot go on, naming rank and action (``errors``)
``forward_pass``       the split backward, reusable on its own (``split``):
``backward_input``     F, then B (input gradient, and W's work: ``WeightPass``),
``backward_weight``    then W (weight gradient), or BW (``backward_full``)
``backward_full``
``WeightPass``
``EmulatedStage``      a stage whose passes take set times (``emulation``)
``emulated_stages``
``emulated_loss``
=====================  ==============================================================

Tied weights: ``PipelineRuntime(tied=...)`` sums them (``tied``), on private gloo groups
(``groups``) that other process groups cannot confuse.

``PostValidatedOptimizer``, ``Verdict``: gradient clipping and the NaN/Inf skip without a
barrier before the optimizer step; ``SyncClippedOptimizer``: its synchronous baseline
(``post_validation``).
"""

from __future__ import annotations

from typing import Any

from .. import _lazy

__all__ = [
    "PipelineRuntime",
    "PipelineError",
    "forward_pass",
    "backward_input",
    "backward_weight",
    "backward_full",
    "WeightPass",
    "EmulatedStage",
    "emulated_stages",
    "emulated_loss",
    "PostValidatedOptimizer",
    "SyncClippedOptimizer",
    "Verdict",
]

_WHERE = {
    "PipelineRuntime": ".runtime",
    "PipelineError": ".errors",
    "forward_pass": ".split",
    "backward_input": ".split",
    "backward_weight": ".split",
    "backward_full": ".split",
    "WeightPass": ".split",
    "EmulatedStage": ".emulation",
    "emulated_stages": ".emulation",
    "emulated_loss": ".emulation",
    "PostValidatedOptimizer": ".post_validation",
    "SyncClippedOptimizer": ".post_validation",
    "Verdict": ".post_validation",
}


def __getattr__(name: str) -> Any:
    return _lazy.load(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted(__all__)
