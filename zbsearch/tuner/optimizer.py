"""What the optimizer costs a rank in bytes and in time, replicated or sharded over the replicas.

Bytes per trainable parameter a rank holds (``zbsearch.planner.memory`` for the replicated
and the fully sharded case, the same rules):

===========  ======================  ===========================================
optimizer    replicated              sharded over dp replicas (ZeRO-1)
===========  ======================  ===========================================
``sgd``      3x the parameter bytes  parameter and gradient, momentum / dp
``adamw``    4x                      parameter and gradient, the two moments / dp
``mixed``    16 bytes                2 + 2 (16-bit parameter and gradient), 12 / dp
===========  ======================  ===========================================

With several replicas each rank also holds one more copy of its gradients, the flat buckets
the runtime reduces them in (``docs/mesh.md``). The gradients reduced are the parameters'
bytes as profiled (16-bit ones under ``mixed``).

Stages ``fully_sharded`` over the replicas (``fully_shard``, as the runtime runs them) hold, at
the step's peak, each parameter and gradient whole (gathered for the step) and 1/dp of the
stored parameters and optimizer state (``planner.memory.parameter_bytes`` with ``shard``), no
buckets; their gradients are reduce-scattered (half an all-reduce's traffic), each replica steps
its share, and the parameters are gathered again for the next step (priced with the step).

The optimizer step streams its state through device memory once: it reads the parameter, the
gradient and the state and writes the parameter and the state (``sgd`` 5x the parameter bytes,
``adamw`` 7x, ``mixed`` 28 bytes per parameter) at the cluster's ``memory_gbs``. Sharded, each
replica steps its 1/dp share, then the updated parameters are gathered from their owners (a
ring all-gather of the parameters' bytes), as ``ZeroRedundancyOptimizer`` does after the
runtime's all-reduce. Without ``memory_gbs`` the step itself is not priced.

``plan`` counts replicated optimizer state by its own rule; ``plan_view`` gives it a per-layer
profile whose parameters, under plan's ``sgd`` rule, hold exactly the bytes above and whose
reductions, at a bandwidth scaled by the same factor (``bandwidth_factor``), take exactly as
long: the planner then chooses cuts for the memory and reductions of this optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ZbError
from ..formats.layers import LayerProfile, TiedParams, Unit
from ..planner.memory import parameter_bytes
from ..reductions import reduction_time

__all__ = ["OptimizerSetup", "OPTIMIZER_NAMES"]

OPTIMIZER_NAMES = ("sgd", "adamw", "mixed")
_STATE = {"sgd": 1.0, "adamw": 2.0}  # state per parameter byte besides the parameter and its gradient
_STEP = {"sgd": 5.0, "adamw": 7.0}  # bytes streamed per parameter byte
_MIXED_KEPT, _MIXED_STATE, _MIXED_STEP = 4.0, 12.0, 28.0  # bytes per parameter


@dataclass(frozen=True)
class OptimizerSetup:
    """An optimizer (``sgd``, ``adamw``, ``mixed``), replicated, its state ``sharded`` over the
    replicas (ZeRO-1), or the stages ``fully_sharded`` over them (``fully_shard``)."""

    name: str
    sharded: bool = False
    fully_sharded: bool = False

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ZbError(f"unknown optimizer {self.name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
        if self.sharded and self.fully_sharded:
            raise ZbError("shard the optimizer state alone (--sharded) or the whole stages (--shard), not both")

    def reduce_scatters(self, dp: int) -> bool:
        """Whether the gradients are reduce-scattered rather than all-reduced over ``dp`` replicas."""
        return self.fully_sharded and dp > 1

    def grad_bytes(self, params: int, param_bytes: float) -> float:
        """Bytes of gradients reduced for ``params`` parameters of ``param_bytes`` bytes."""
        return 2.0 * params if self.name == "mixed" else param_bytes

    def static_bytes(self, params: int, param_bytes: float, dp: int) -> float:
        """Bytes a rank holds for these parameters: themselves, gradients, state, buckets."""
        if self.reduce_scatters(dp):
            return parameter_bytes(params, param_bytes, self.name, shard=dp)
        share = 1.0 / dp if self.sharded else 1.0
        if self.name == "mixed":
            held = (_MIXED_KEPT + _MIXED_STATE * share) * params
        else:
            held = (2.0 + _STATE[self.name] * share) * param_bytes
        return held + (self.grad_bytes(params, param_bytes) if dp > 1 else 0.0)

    def step_ms(self, params: int, param_bytes: float, dp: int, memory_gbs: float | None, dp_gbs: float) -> float:
        """The optimizer step of these parameters on one rank (ms): its share of the state
        streamed at ``memory_gbs``, then, sharded, the gather of the updated parameters."""
        streamed = _MIXED_STEP * params if self.name == "mixed" else _STEP[self.name] * param_bytes
        if not (self.sharded or self.fully_sharded) or dp == 1:
            return 0.0 if memory_gbs is None else streamed / (memory_gbs * 1e9) * 1e3
        step = 0.0 if memory_gbs is None else streamed / dp / (memory_gbs * 1e9) * 1e3
        return step + reduction_time(self.grad_bytes(params, param_bytes), dp, dp_gbs, sharded=True)

    def factor(self, dp: int) -> float:
        """Static bytes per gradient byte (``static_bytes / grad_bytes``, the same for every unit)."""
        return self.static_bytes(1, 1.0, dp) / self.grad_bytes(1, 1.0)

    def bandwidth_factor(self, dp: int) -> float:
        """What the reductions' bandwidth is multiplied by for ``plan_view``'s gradient bytes
        (plan all-reduces them: twice as fast where the stages reduce-scatter)."""
        return self.factor(dp) / 3.0 * (2.0 if self.reduce_scatters(dp) else 1.0)

    def plan_view(self, layers: LayerProfile, dp: int) -> LayerProfile:
        """``layers`` with parameter bytes that plan's ``sgd`` rule (3x) counts as this
        optimizer's static bytes (see the module); the units' costs are unchanged."""
        units = [_scaled(u, self.static_bytes(u.params, u.param_bytes, dp) / 3.0) for u in layers.units]
        tied = {k: TiedParams(params=t.params, param_bytes=self.static_bytes(t.params, t.param_bytes, dp) / 3.0)
                for k, t in layers.tied.items()}
        return layers.model_copy(update={"units": units, "tied": tied})

    def __str__(self) -> str:
        return f"{self.name}{' sharded' if self.sharded else ''}{', stages sharded' if self.fully_sharded else ''}"


def _scaled(u: Unit, param_bytes: float) -> Unit:
    return u.model_copy(update={"param_bytes": param_bytes})
