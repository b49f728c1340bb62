"""Memory limits as users write them: ``1p``, ``2p``, ``1.5p``, ``40GiB``, ``none``.

``<x>p`` means x * p * M_B per rank, with M_B the activations one microbatch leaves on that
rank after its forwards (the sum of m_f over the rank's stages): 1p is what 1F1B needs, 2p is
the paper's ZB-2p. A byte budget applies to every rank and needs a profile measured in bytes.

``fits`` is the one test of a memory value against a limit (validator, solver, bounds and the
CLI all use it): a value may pass the limit by float noise in sums of per-pass deltas.
"""

from __future__ import annotations

import re

from .costs import CostModel
from .errors import ZbError
from .formats.profile import Profile

__all__ = ["parse_memory_limit", "fits", "allowance"]

# Tolerance of ``fits``: relative, plus absolute for limits near zero.
_RTOL, _ATOL = 1e-9, 1e-12

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_limit(text: str | None, profile: Profile, cost: CostModel) -> list[float] | None:
    """Per-rank limits, or None for unlimited."""
    if text is None or text.strip().lower() in ("", "none", "inf", "unlimited"):
        return None
    t = text.strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*p", t)
    if m:
        x = float(m.group(1))
        if x <= 0:
            raise ZbError(f"memory limit {text!r} must be positive")
        p = cost.num_ranks
        return [x * p * cost.activation_unit(r) for r in range(p)]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?", t)
    if m:
        if profile.memory_unit != "bytes":
            raise ZbError(
                f"memory limit {text!r} is a byte budget but profile {profile.name!r} measures memory in "
                f"{profile.memory_unit}; use a multiple of p such as 2p"
            )
        value = float(m.group(1)) * _UNITS[m.group(2) or ""]
        if value <= 0:
            raise ZbError(f"memory limit {text!r} must be positive")
        return [value] * cost.num_ranks
    raise ZbError(f"cannot read memory limit {text!r}: use e.g. 1p, 2p, 1.5p, 40GiB or none")


def allowance(limit: float) -> float:
    """The most memory ``fits`` accepts under ``limit``."""
    return limit * (1 + _RTOL) + _ATOL


def fits(value: float, limit: float) -> bool:
    """Whether ``value`` (a peak or a running total of memory) stays within ``limit``."""
    return value <= allowance(limit)
