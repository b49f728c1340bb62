"""The classic, closed-form pipeline schedules, for comparison with solver output.

Each lives in its own small file and is readable top to bottom. ``build_classic`` turns a
kind name, a profile and m into a schedule with its prediction attached.
"""

from __future__ import annotations

from ..costs import CostModel
from ..errors import ZbError
from ..predict import with_prediction
from ..formats.profile import Profile
from ..formats.schedule import Schedule, looped_placement, v_placement
from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .zb_h import zb_h1, zb_h2
from .zb_v import zb_v

__all__ = ["CLASSIC_KINDS", "build_classic"]

CLASSIC_KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
_ALIASES = {"1f1b-i": "interleaved-1f1b", "interleaved": "interleaved-1f1b", "zbv": "zb-v", "zbh1": "zb-h1", "zbh2": "zb-h2"}


def build_classic(kind: str, profile: Profile, num_microbatches: int, chunks: int | None = None) -> Schedule:
    """Build a classic schedule on the profile's ranks (one per stage, or its placement's)."""
    kind = _ALIASES.get(kind.lower(), kind.lower())
    p, m = profile.num_ranks, num_microbatches
    if kind not in CLASSIC_KINDS:
        raise ZbError(f"unknown schedule kind {kind!r}; choose one of: {', '.join(CLASSIC_KINDS)}")
    if m < 1:
        raise ZbError("the number of microbatches must be at least 1")
    if kind == "interleaved-1f1b":
        v = (profile.chunks if profile.placement is not None else 2) if chunks is None else chunks
        placement = looped_placement(p, v)
    elif kind == "zb-v":
        if chunks not in (None, 2):
            raise ZbError("zb-v always uses 2 chunks per rank")
        placement = v_placement(p)
    else:
        if chunks not in (None, 1):
            raise ZbError(f"{kind} uses 1 chunk per rank; --chunks applies to interleaved-1f1b")
        placement = list(range(p))
    cost = CostModel.from_profile(profile, placement)
    if kind == "gpipe":
        actions = gpipe(p, m)
    elif kind == "1f1b":
        actions = one_f_one_b(p, m)
    elif kind == "interleaved-1f1b":
        actions = interleaved_1f1b(p, m, len(placement) // p)
    elif kind == "zb-h1":
        actions = zb_h1(cost, m)
    elif kind == "zb-h2":
        actions = zb_h2(p, m)
    else:
        actions = zb_v(cost, m)
    return with_prediction(Schedule.build(kind, profile, m, placement, actions))
