"""Plan the whole pipeline: the cut of a model's units into stages, the placement and the
schedule, chosen together under a per-rank byte budget, with a bound over every cut.

=====================  ============================================================
``plan``               the best cut, placement and schedule found (``plan``)
``PlanResult``
``Cut``                units per stage under a placement (``compose``)
``stage_profile``      the stage profile a cut gives
``baseline_cuts``      even, torchtitan's and Megatron's cuts (``baselines``)
``parameter_bytes``    parameters, gradients, optimizer state (``memory``)
``llama_layers``       a per-layer profile from a Llama-like shape (``analytic``)
``torchtitan_export``  a plan as torchtitan options and schedule CSV (``torchtitan``)
=====================  ============================================================

Torch-free, like the solver it calls.
"""

from .analytic import llama_layers
from .baselines import BaselineCut, baseline_cuts
from .compose import Cut, stage_cost, stage_profile
from .memory import OPTIMIZERS, parameter_bytes, rank_static_bytes
from .plan import PlanResult, plan

__all__ = [
    "plan", "PlanResult", "Cut", "stage_profile", "stage_cost", "baseline_cuts", "BaselineCut", "parameter_bytes",
    "rank_static_bytes", "OPTIMIZERS", "llama_layers",
]
