"""The classic, closed-form pipeline schedules, for comparison with solver output.

Each lives in its own small file and is readable top to bottom. ``KINDS`` names every kind
with its placement and its builder, all called the same way, ``build(cost, m)``; a kind names
one order. ``build_classic`` turns a kind name, a profile and m into a schedule with its
prediction attached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..actions import Action
from ..costs import CostModel
from ..errors import ZbError
from ..formats.profile import Profile
from ..formats.schedule import Schedule
from ..layout import Layout, placement
from ..prediction import with_prediction
from .controllable import v_half, v_min
from .dualpipe_v import dualpipe_v, dualpipe_v_pairs
from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b, one_f_one_b_split
from .recompute import one_f_one_b_recompute, one_f_one_b_split_recompute, zb_h1_recompute
from .zb_h import zb_h1, zb_h2
from .zb_v import zb_v

__all__ = ["ClassicKind", "KINDS", "CLASSIC_KINDS", "build_classic"]

Builder = Callable[..., list[list[Action]]]  # (cost, m), and a deadline keyword where ``timed``
Pairing = Callable[[CostModel, int], list[list[int]]]  # (cost, m) -> per rank, the builder's overlapped pairs


@dataclass(frozen=True)
class ClassicKind:
    """A classic schedule kind: its builder and the placement it builds for."""

    build: Builder
    layout: Layout = "looped"
    chunks: int = 1
    any_chunks: bool = False  # whether ``--chunks`` may change ``chunks``
    timed: bool = False  # the builder improves its schedule as far as a ``deadline`` keyword allows (``deadline``)
    recompute: bool = False  # every microbatch recomputed: needs the profile's recomputation costs
    pairs: Pairing | None = None  # the forward-backward pairs the kind overlaps where the profile has all-to-all

    def overlapped(self, cost: CostModel, m: int, overlap: bool | None = None) -> list[list[int]] | None:
        """The kind's overlapped pairs (``Schedule.overlapped``) on ``cost``: where it has some and
        ``overlap`` is True, or None (the default) and the costs hold all-to-all to hide; else None."""
        if self.pairs is None or not (cost.has_all_to_all if overlap is None else overlap):
            return None
        return self.pairs(cost, m)

    def build_by(self, cost: CostModel, m: int, deadline: float | None = None) -> list[list[Action]]:
        """``build``, cut at ``deadline`` (a ``time.monotonic()`` instant) where the builder can be
        (``deadline.passed``)."""
        return self.build(cost, m, deadline=deadline) if self.timed else self.build(cost, m)


KINDS: dict[str, ClassicKind] = {
    "gpipe": ClassicKind(gpipe),
    "1f1b": ClassicKind(one_f_one_b),
    "1f1b-split": ClassicKind(one_f_one_b_split),
    "interleaved-1f1b": ClassicKind(interleaved_1f1b, chunks=2, any_chunks=True),
    "zb-h1": ClassicKind(zb_h1),
    "zb-h2": ClassicKind(zb_h2),
    "zb-v": ClassicKind(zb_v, layout="v", chunks=2, timed=True),
    "v-half": ClassicKind(v_half, layout="v", chunks=2, timed=True),
    "v-min": ClassicKind(v_min, layout="v", chunks=2, timed=True),
    "dualpipe-v": ClassicKind(dualpipe_v, layout="v", chunks=2, pairs=dualpipe_v_pairs),
    "1f1b-recompute": ClassicKind(one_f_one_b_recompute, recompute=True),
    "1f1b-split-recompute": ClassicKind(one_f_one_b_split_recompute, recompute=True),
    "zb-h1-recompute": ClassicKind(zb_h1_recompute, recompute=True),
}
CLASSIC_KINDS = tuple(KINDS)
_ALIASES = {"1f1b-i": "interleaved-1f1b", "interleaved": "interleaved-1f1b", "zbv": "zb-v", "zbh1": "zb-h1", "zbh2": "zb-h2",
            "vhalf": "v-half", "vmin": "v-min", "dualpipev": "dualpipe-v"}


def build_classic(
    kind: str, profile: Profile, num_microbatches: int, chunks: int | None = None, deadline: float | None = None,
    overlap: bool | None = None,
) -> Schedule:
    """Build a classic schedule on the profile's ranks (one per stage, or its placement's);
    a builder that improves its schedule step by step stops at ``deadline`` (``ClassicKind.build_by``).
    A kind that overlaps forward-backward pairs (dualpipe-v) marks them where the profile has
    all-to-all to hide, or as ``overlap`` says (False: its passes one after the other)."""
    name = _ALIASES.get(kind.lower(), kind.lower())
    if name not in KINDS:
        raise ZbError(f"unknown schedule kind {name!r}; choose one of: {', '.join(CLASSIC_KINDS)}")
    spec = KINDS[name]
    if chunks is not None and chunks != spec.chunks and not spec.any_chunks:
        raise ZbError(f"{name} uses {spec.chunks} chunk(s) per rank; --chunks applies to interleaved-1f1b")
    if chunks is None:  # a profile of pieces measured for interleaving says how many per rank
        chunks = profile.chunks if spec.any_chunks and profile.placement is not None else spec.chunks
    stage_to_rank = placement(profile.num_ranks, chunks, spec.layout)
    cost = CostModel.from_profile(profile, stage_to_rank)
    cost.check_microbatches(num_microbatches)
    actions = spec.build_by(cost, num_microbatches, deadline)
    pairs = spec.overlapped(cost, num_microbatches, overlap)
    return with_prediction(Schedule.build(name, profile, num_microbatches, stage_to_rank, actions, overlapped=pairs))
