"""What a rank holds besides activations: parameters, gradients and optimizer state.

The bytes per trainable parameter each optimizer needs, as the rule of one place:

* ``sgd``: SGD with momentum: the parameter, its gradient and one momentum buffer, each in
  the parameter's dtype (3x the parameter bytes);
* ``adamw``: AdamW with fp32 parameters (torch's ``AdamW``): the parameter, its gradient and
  the two moments, each in the parameter's dtype (4x; torch keeps the step counters on the host);
* ``mixed``: mixed-precision AdamW as the ZeRO paper counts it: 16-bit parameters and
  gradients, an fp32 master copy and two fp32 moments (16 bytes per parameter, whatever the
  profiled dtype).

Sharded data parallelism (``shard=d``: stages under ``fully_shard`` over ``d`` ranks, run by
the runtime, which gathers a stage's parameters once per step and keeps them until its last
backward): at the step's peak a rank holds each parameter and gradient whole (the gathered
copy and the gradients accumulated over the microbatches, before their reduce-scatter), plus
its ``1/d`` share of what persists between steps: the parameters as stored and the optimizer
state. So ``sgd`` holds ``2 + 2/d`` times the parameter bytes, ``adamw`` ``2 + 3/d``, and
``mixed`` ``4 + 12/d`` bytes per parameter (16-bit working copies and gradients, the fp32
master as the stored parameter, two fp32 moments). Shards are taken as even: FSDP pads a
dimension that ``d`` does not divide, a few bytes per parameter tensor.

Parameters without gradient and buffers count once, as profiled. Tied parameters (an embedding
and the LM head that share a weight) count once on a rank that holds several of their units,
and once on each rank that holds any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from ..errors import ZbError
from ..formats.layers import LayerProfile

__all__ = ["Optimizer", "OPTIMIZERS", "parameter_bytes", "rank_static_bytes"]

Optimizer = Literal["sgd", "adamw", "mixed"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
_MIXED_BYTES_PER_PARAM = 16


def parameter_bytes(params: int, param_bytes: float, optimizer: str, shard: int | None = None) -> float:
    """Bytes that ``params`` trainable parameters (``param_bytes`` as profiled) hold under
    ``optimizer``: parameters, gradients and optimizer state; with ``shard=d``, at the peak of
    a step of stages sharded over ``d`` ranks (module docstring)."""
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 1):
        raise ZbError(f"shard must be a positive whole number of ranks, not {shard!r}")
    if optimizer == "sgd":
        working, kept = 2 * param_bytes, 2 * param_bytes  # parameter + gradient; parameter + momentum
    elif optimizer == "adamw":
        working, kept = 2 * param_bytes, 3 * param_bytes  # parameter + gradient; parameter + two moments
    elif optimizer == "mixed":
        working, kept = 4.0 * params, float((_MIXED_BYTES_PER_PARAM - 4) * params)  # 16-bit copies; fp32 master + moments
    else:
        raise ZbError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if shard is None:  # one copy of each: the working parameter is the stored one
        return working + kept - (param_bytes if optimizer != "mixed" else 0.0)
    return working + kept / shard


def rank_static_bytes(layers: LayerProfile, rank_units: Sequence[Sequence[int]], optimizer: str,
                      shard: int | None = None) -> list[float]:
    """Per rank, the bytes of the parameters, gradients and optimizer state of the units it
    holds (``rank_units[r]``: unit indices), tied parameters once per rank; ``shard``: sharded
    over that many data-parallel ranks."""
    out = []
    for units in rank_units:
        total, keys = 0.0, set()
        for i in units:
            u = layers.units[i]
            total += parameter_bytes(u.params, u.param_bytes, optimizer, shard) + u.frozen_bytes
            keys.update(u.tied)
        for k in sorted(keys):
            t = layers.tied[k]
            total += parameter_bytes(t.params, t.param_bytes, optimizer, shard)
        out.append(total)
    return out
