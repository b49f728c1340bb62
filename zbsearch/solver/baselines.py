"""The classic schedules as the solver's baselines: every kind that applies and fits the limit.

``solve`` takes each of them as a candidate, so it never returns a schedule worse than the
best of them, and reports their values so that a user sees what the solver beat and by how
much. With one chunk per rank they are GPipe, 1F1B, 1F1B with split backwards, ZB-H1 and
ZB-H2, and where recomputation is allowed 1F1B and ZB-H1 recomputing every microbatch; with
two, ZB-V, V-Half, V-Min and DualPipeV on the solver's V placement and interleaved 1F1B on its
own (looped) placement, whose schedules the solver's search does not range over: it stays a
candidate as it is. A kind is left out where it does not apply (interleaved 1F1B needs m to be a multiple
of p), where the profile's pieces were measured for another placement, or where its memory
exceeds the limit (each placement's limit: ``<x>p`` counts that placement's M_B). Each costs a
build and a simulation, which at the largest sizes and shortest time limits may not fit: a
kind not built in time is named, never silently left out. Where the passes hold all-to-all the
solver builds DualPipeV (with its pairs) however short the time, so that it never returns a
schedule slower than the hand-made one for such models.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .. import clock
from ..actions import Action
from ..classic import KINDS
from ..costs import CostModel
from ..errors import ZbError
from ..formats.profile import Profile
from ..layout import placement
from ..limits import parse_memory_limit
from ..simulator import Timeline
from .problem import Objective, Problem, Recomputation

__all__ = ["Baseline", "CLASSIC_BY_CHUNKS", "classic_baselines"]

# The classic kinds the solver compares with, by chunks per rank; and those that recompute every
# microbatch, where recomputation is allowed (with "full", only those).
CLASSIC_BY_CHUNKS = {1: ("gpipe", "1f1b", "1f1b-split", "zb-h1", "zb-h2"),
                     2: ("zb-v", "v-half", "v-min", "dualpipe-v", "interleaved-1f1b")}
RECOMPUTING_BY_CHUNKS = {1: ("1f1b-recompute", "1f1b-split-recompute", "zb-h1-recompute"), 2: ()}


@dataclass
class Baseline:
    """A classic schedule within the limit, timed on its placement."""

    kind: str
    value: float
    rows: list[list[Action]]
    stage_to_rank: list[int]
    timeline: Timeline
    limit: list[float] | None  # per rank on its placement
    pairs: list[list[int]] | None = None  # the kind's overlapped pairs (dualpipe-v where the passes hold all-to-all)


def classic_baselines(
    profile: Profile, m: int, mem_limit: str | Sequence[float] | None, chunks: int, objective: Objective,
    deadline: float | None = None, until: float | None = None,
    built: dict[str, tuple[list[list[Action]], Timeline | None]] | None = None, skip: Collection[str] = (),
    recompute: Recomputation = "none", always: Collection[str] = (),
) -> tuple[list[Baseline], list[str]]:
    """Each classic kind for ``chunks`` (but those in ``skip``) that applies and fits
    ``mem_limit`` (text as the user wrote it, per-rank values, or None), timed, and the kinds
    not built because ``until`` (a ``deadline.now()`` instant) had passed. ``built``: kinds
    already built on their placement under these costs, with their timelines where simulated
    (None: over the limit); ``deadline``: for kinds that repeat their construction (ZB-V).
    ``recompute``: the recomputation allowed (the recomputing kinds join where it is not
    "none"; with "full" they are the only ones). ``always``: kinds built and timed even once
    ``until`` has passed."""
    out, late = [], []
    recomputing = RECOMPUTING_BY_CHUNKS.get(chunks, ()) if recompute != "none" else ()
    kinds = recomputing if recompute == "full" else CLASSIC_BY_CHUNKS.get(chunks, ()) + recomputing
    for kind in kinds:
        if kind in skip:
            continue
        done = built.get(kind) if built else None
        if done is None and until is not None and clock.now() > until and kind not in always:
            late.append(kind)
            continue
        spec = KINDS[kind]
        stage_to_rank = placement(profile.num_ranks, spec.chunks, spec.layout)
        if profile.placement is not None and profile.placement != stage_to_rank:
            continue  # pieces measured for another placement
        try:
            cost = CostModel.from_profile(profile, stage_to_rank)
            rows = done[0] if done is not None else spec.build_by(cost, m, deadline)
        except ZbError:
            continue  # the kind does not apply here (e.g. m not a multiple of p)
        if mem_limit is None or isinstance(mem_limit, str):
            limit = parse_memory_limit(mem_limit, profile, cost)
        else:
            limit = list(mem_limit)
        problem = Problem.make(cost, m, tuple(limit) if limit is not None else None, objective, recompute)
        pairs = spec.overlapped(cost, m)
        if done is not None and done[1] is not None and pairs is None:
            value, tl = problem.value(done[1]), done[1]
        elif not problem.fits_order(rows):
            continue
        else:
            value, tl = problem.evaluate(rows, pairs)
        if problem.fits(tl):
            out.append(Baseline(kind, value, rows, stage_to_rank, tl, limit, pairs))
    return out, late
