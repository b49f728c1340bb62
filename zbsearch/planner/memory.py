"""What a rank holds besides activations: parameters, gradients and optimizer state.

The bytes per trainable parameter each optimizer needs, as the rule of one place:

* ``sgd``: SGD with momentum: the parameter, its gradient and one momentum buffer, each in
  the parameter's dtype (3x the parameter bytes);
* ``adamw``: AdamW with fp32 parameters (torch's ``AdamW``): the parameter, its gradient and
  the two moments, each in the parameter's dtype (4x; torch keeps the step counters on the host);
* ``mixed``: mixed-precision AdamW as the ZeRO paper counts it: 16-bit parameters and
  gradients, an fp32 master copy and two fp32 moments (16 bytes per parameter, whatever the
  profiled dtype).

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


def parameter_bytes(params: int, param_bytes: float, optimizer: str) -> float:
    """Bytes that ``params`` trainable parameters (``param_bytes`` as profiled) hold under
    ``optimizer``: parameters, gradients and optimizer state."""
    if optimizer == "sgd":
        return 3 * param_bytes
    if optimizer == "adamw":
        return 4 * param_bytes
    if optimizer == "mixed":
        return float(_MIXED_BYTES_PER_PARAM * params)
    raise ZbError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")


def rank_static_bytes(layers: LayerProfile, rank_units: Sequence[Sequence[int]], optimizer: str) -> list[float]:
    """Per rank, the bytes of the parameters, gradients and optimizer state of the units it
    holds (``rank_units[r]``: unit indices), tied parameters once per rank."""
    out = []
    for units in rank_units:
        total, keys = 0.0, set()
        for i in units:
            u = layers.units[i]
            total += parameter_bytes(u.params, u.param_bytes, optimizer) + u.frozen_bytes
            keys.update(u.tied)
        for k in sorted(keys):
            t = layers.tied[k]
            total += parameter_bytes(t.params, t.param_bytes, optimizer)
        out.append(total)
    return out
