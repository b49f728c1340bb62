"""Memory limits as users write them: ``1p``, ``2p``, ``1.5p``, ``1e9p``, ``40GiB``, ``capacity``, ``none``.

``<x>p`` means x * p * M_B per rank, with M_B the activations one microbatch leaves on that
rank after its forwards (the sum of m_f over the rank's stages): 1p is what 1F1B needs, 2p is
the paper's ZB-2p. On a rank whose stages keep no activations (M_B = 0, e.g. a parameter-free
first stage measured by ``zbsearch profile``) ``<x>p`` is 0: that rank may not hold memory at
all, which it never needs to when its memory deltas are all zero. A byte budget applies to
every rank and needs a profile measured in bytes. ``capacity`` is the profile's
``memory_capacity``: one budget per rank, in the profile's memory unit.

The text is kept beside the values in a schedule (``memory_limit_spec``) so that checking the
schedule against another profile recomputes the limit in that profile's units.

``fits`` is the one test of a memory value against a limit (validator, solver, bounds and the
CLI all use it): a value may pass the limit by float noise in sums of per-pass deltas.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from .costs import CostModel
from .errors import ZbError
from .formats.profile import Profile
from .tolerances import ABS_TOL, REL_TOL

__all__ = ["parse_memory_limit", "parse_bytes", "fits", "peaks_fit", "allowance", "limit_for_profile"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
_HELP = "use e.g. 1p, 2p, 1.5p, 40GiB, capacity or none"


def _positive(value: float, text: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ZbError(f"memory limit {text!r} must be a positive finite amount")
    return value


def parse_memory_limit(text: str | None, profile: Profile, cost: CostModel) -> list[float] | None:
    """Per-rank limits, or None for unlimited (``text`` None or ``none``)."""
    if text is None:
        return None
    t = text.strip().lower()
    if not t:
        raise ZbError(f"memory limit {text!r} is empty; {_HELP}")
    if t in ("none", "inf", "unlimited"):
        return None
    p = cost.num_ranks
    if t == "capacity":
        cap = profile.memory_capacity
        if cap is None:
            raise ZbError(f"memory limit 'capacity': profile {profile.name!r} has no memory_capacity")
        if len(cap) != p:
            raise ZbError(f"memory limit 'capacity': profile {profile.name!r} gives {len(cap)} capacities for {p} ranks")
        return list(cap)
    m = re.fullmatch(_NUMBER + r"\s*p", t)
    if m:
        x = _positive(float(m.group(1)), text)
        limit = [x * p * cost.activation_unit(r) for r in range(p)]
        if not all(math.isfinite(v) for v in limit):
            raise ZbError(f"memory limit {text!r} is too large to represent")
        return limit
    m = re.fullmatch(_NUMBER + r"\s*([kmgt]i?b|b)?", t)
    if m:
        if profile.memory_unit != "bytes":
            raise ZbError(
                f"memory limit {text!r} is a byte budget but profile {profile.name!r} measures memory in "
                f"{profile.memory_unit}; use a multiple of p such as 2p"
            )
        return [_positive(float(m.group(1)) * _UNITS[m.group(2) or ""], text)] * p
    raise ZbError(f"cannot read memory limit {text!r}: {_HELP}")


def parse_bytes(text: str) -> float | None:
    """A byte budget as users write it (``80GiB``, ``7.5e10``, ``512MB``), or None for ``none``."""
    t = text.strip().lower()
    if t in ("none", "inf", "unlimited"):
        return None
    m = re.fullmatch(_NUMBER + r"\s*([kmgt]i?b|b)?", t)
    if not m:
        raise ZbError(f"cannot read the byte budget {text!r}: use e.g. 80GiB, 512MiB, 7.5e10 or none")
    value = float(m.group(1)) * _UNITS[m.group(2) or ""]
    return _positive(value, text)


def limit_for_profile(memory_limit: list[float] | None, spec: str | None, old: Profile, new: Profile,
                      stage_to_rank: list[int]) -> list[float] | None:
    """A schedule's memory limit (``memory_limit``, asked for as ``spec``, under profile ``old``)
    in the units of profile ``new``: recomputed from the spec, or kept where it means the same
    thing (bytes for bytes, or the same M_B per rank); otherwise one ZbError line."""
    if memory_limit is None:
        return None
    new_cost = CostModel.from_profile(new, stage_to_rank)
    if spec:
        return parse_memory_limit(spec, new, new_cost)
    if old.memory_unit == new.memory_unit:
        if new.memory_unit == "bytes":
            return list(memory_limit)
        old_cost = CostModel.from_profile(old, stage_to_rank)
        units = [(old_cost.activation_unit(r), new_cost.activation_unit(r)) for r in range(new_cost.num_ranks)]
        if all(math.isclose(a, b, rel_tol=REL_TOL) for a, b in units):
            return list(memory_limit)
    raise ZbError(
        f"the schedule's memory limit is in the units of profile {old.name!r} ({old.memory_unit}) and the "
        f"schedule does not say how it was asked for; give the limit for profile {new.name!r} with --mem-limit"
    )


def allowance(limit: float) -> float:
    """The most memory ``fits`` accepts under ``limit``."""
    return limit * (1 + REL_TOL) + ABS_TOL


def fits(value: float, limit: float) -> bool:
    """Whether ``value`` (a peak or a running total of memory) stays within ``limit``."""
    return value <= allowance(limit)


def peaks_fit(peaks: Sequence[float], limit: Sequence[float] | None) -> bool:
    """Whether each rank's peak memory stays within its limit (None: no limit)."""
    return limit is None or all(fits(pk, x) for pk, x in zip(peaks, limit))
