"""A cut of the units into stages, and the stage profile, memory and limits it gives.

A ``Cut`` is the number of consecutive units on each stage, in stage order, and a placement:
``one`` (P stages, stage s on rank s) or ``v`` (2P pieces, piece s on rank s going down and on
rank 2P-1-s coming back, as ZB-V places them). Every unit is on exactly one stage, in model
order, so a cut can neither drop, repeat nor reorder a unit (``check_names`` says which a list
of unit names per stage does).

A stage's costs follow from its units' (each measured as a stage of its own):

* F, the forward before a fused backward (t_ff), the fused backward (t_bw) and the memory F
  allocates add up over the units;
* on later stages B and W add up too: the stage's input gradient runs each unit's input
  gradient in turn, and its weight gradient each unit's;
* the first stage needs no input gradient: its B is its first unit's (nothing to do) and its W
  is the whole backward, one plain backward through its units: the first unit's W and the
  fused backward of the others. What B frees is its first unit's, W frees the rest. Its F is
  not split either (the runtime runs a first stage's forward as it is, with nothing deferred),
  so it is its units' plain forwards (t_ff), not their split ones: every unit but the first
  was measured as a later stage, whose split forward costs more.

Recomputation, where the units offer it (``Unit`` carries a stage profile's recompute fields,
each unit measured as a stage of its own):

* full: a stage offers it where every unit does. A checkpointed stage keeps only its input, the
  tensor entering its first unit, and the RNG state: its first unit's ``m_fc``. Its recompute
  pass re-runs every unit's forward (the sum of their ``t_r``; before a fused backward, of their
  ``t_rf`` where measured), its checkpointed forward costs
  the sum of theirs (``t_fc``, else the unit's forward as the stage runs it). A unit measured
  alone records at most what its plain forward keeps, so an embedding (whose input is the
  batch, not counted) records less than the RNG state it keeps: where a first unit's ``m_fc``
  reached its m_f, the stage keeps its input's bytes and the profile's
  ``checkpoint_state_bytes``. Where that is more than the stage's m_f (a tiny stage), the stage
  does not offer full recomputation, as the profiler would not offer it for that stage;
* selective: a stage offers it where some unit does, and it adds up: what the checkpointed
  forward keeps is the offering units' ``m_fs`` and the others' whole ``m_f``, the recompute
  pass the offering units' ``t_rs``.

Expert-parallel all-to-all (a mixture-of-experts model's units, ``a_f`` and ``a_b``): a stage's
is its units' sum, inside its F and its B, and the stage profile records the per-layer
profile's ``ep`` in its mesh section. Where units measured the share of a pair's hidden all-to-all
that stays exposed (``pair_exposed``), the stage's is the larger of its units' shares weighted by
their ``a_f`` and by their ``a_b``: never less exposed than its units together, so bounds on the
units hold for the stage. A first stage holding all-to-all is split as later stages
are (the runtime splits a first stage with experts, so that its mirrors run in B, where the
costs put them): its F, B and W are its units' split ones, summed.

Links cost the boundary unit's ``LayerProfile.comm``; a hand-over between two pieces of one
rank costs nothing (the cost model sees to it). The runtime's host time per action
(``LayerProfile.t_action``) is every stage's, whole: it does not shrink with a stage's units,
and the cost model adds it to each pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ZbError
from ..formats.layers import LayerProfile, Unit
from ..formats.mesh import ProfileMesh
from ..formats.partition import check_names
from ..formats.profile import MIN_TIME_MS, LaneSharing, Profile, StageCost
from ..layout import placement as layout
from ..reductions import with_reductions
from .memory import rank_static_bytes

__all__ = ["Placement", "Cut", "check_names", "stage_cost", "stage_profile", "activation_need", "least_kept"]

Placement = Literal["one", "v"]


@dataclass(frozen=True)
class Cut:
    """Units per stage (``counts``, stage order) under ``placement`` on ``num_ranks`` ranks."""

    counts: tuple[int, ...]
    placement: Placement

    @property
    def chunks(self) -> int:
        """Stages per rank: 1 (one) or 2 (v)."""
        return 2 if self.placement == "v" else 1

    @property
    def num_ranks(self) -> int:
        """Ranks: one stage each, or two pieces each in a V."""
        return len(self.counts) // self.chunks

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Per stage, its units ``[lo, hi)``."""
        out, lo = [], 0
        for k in self.counts:
            out.append((lo, lo + k))
            lo += k
        return out

    @property
    def stage_to_rank(self) -> list[int]:
        """The rank of each stage."""
        return layout(self.num_ranks, self.chunks, "v")

    def rank_units(self) -> list[list[int]]:
        """Per rank, the indices of the units it holds."""
        out: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for (lo, hi), r in zip(self.bounds, self.stage_to_rank):
            out[r].extend(range(lo, hi))
        return out

    def check(self, num_units: int) -> None:
        """One line if the cut does not hold ``num_units`` units, each stage at least one."""
        if len(self.counts) % self.chunks or not self.counts:
            raise ZbError(f"a {self.placement} cut needs a multiple of {self.chunks} stages, not {len(self.counts)}")
        empty = [s for s, k in enumerate(self.counts) if k < 1]
        if empty:
            raise ZbError(f"stage {empty[0]} of the cut {list(self.counts)} holds no unit")
        if sum(self.counts) != num_units:
            raise ZbError(f"the cut {list(self.counts)} holds {sum(self.counts)} units but the model has {num_units}")

    def names(self, layers: LayerProfile) -> list[list[str]]:
        """The unit names of each stage."""
        return [layers.names[lo:hi] for lo, hi in self.bounds]

    def __str__(self) -> str:
        return f"{self.placement}:{','.join(map(str, self.counts))}"


def stage_cost(layers: LayerProfile, lo: int, hi: int) -> StageCost:
    """The costs of one stage holding units ``[lo, hi)`` (see the module for the rule)."""
    us = layers.units[lo:hi]
    t_f = sum(u.t_f for u in us)
    t_ff = sum(u.fused_forward for u in us)
    extra = _stage_recompute(layers, lo, hi)
    t_bw = sum(u.fused_backward for u in us)
    m_f = sum(u.m_f for u in us)
    a_f, a_b = sum(u.a_f for u in us), sum(u.a_b for u in us)
    if a_f or a_b:
        extra.update(a_f=a_f, a_b=a_b)
        if any(u.pair_exposed for u in us):
            extra["pair_exposed"] = min(1.0, max(sum((u.pair_exposed or 0.0) * getattr(u, a) for u in us) / total
                                                 for a, total in (("a_f", a_f), ("a_b", a_b)) if total > 0))
    if _plain_first(layers, lo, hi):  # the first stage: no input gradient, its W is the whole backward, its F not split
        first = us[0]
        t_f = t_ff
        t_b, m_b = first.t_b, first.m_b
        t_w = first.t_w + sum(u.fused_backward for u in us[1:])
    else:
        t_b, t_w, m_b = sum(u.t_b for u in us), sum(u.t_w for u in us), sum(u.m_b for u in us)
    return StageCost(t_f=max(t_f, MIN_TIME_MS), t_b=max(t_b, MIN_TIME_MS), t_w=max(t_w, 0.0), m_f=m_f, m_b=m_b,
                     m_w=-(m_f + m_b), t_bw=max(t_bw, MIN_TIME_MS), t_ff=max(t_ff, MIN_TIME_MS), **extra)


def _stage_recompute(layers: LayerProfile, lo: int, hi: int) -> dict[str, float]:
    """The recompute fields of the stage of units ``[lo, hi)`` (see the module), none where its
    units do not offer them."""
    us = layers.units[lo:hi]

    plain = _plain_first(layers, lo, hi)

    def forward(u: Unit) -> float:  # a unit's forward as the stage runs it (not split on a plain first stage)
        return u.fused_forward if plain else u.t_f

    out: dict[str, float] = {}
    m_f = sum(u.m_f for u in us)
    kept = _kept_input(layers, lo) if all(u.t_r is not None and u.m_fc is not None for u in us) else None
    if kept is not None and kept <= m_f:  # offered where the checkpointed forward keeps no more than a plain one
        out.update(t_fc=max(sum(forward(u) if u.t_fc is None else u.t_fc for u in us), MIN_TIME_MS),
                   t_r=max(sum(u.t_r for u in us), MIN_TIME_MS),  # type: ignore[misc]
                   m_fc=kept)
        if any(u.t_rf is not None for u in us):  # before a fused backward: each unit's plain forward again
            out["t_rf"] = max(sum(u.fused_recompute for u in us), MIN_TIME_MS)  # type: ignore[misc]
    offers = [u.t_rs is not None and u.m_fs is not None for u in us]
    if any(offers):
        out.update(t_fs=max(sum(u.t_fs if o and u.t_fs is not None else forward(u) for u, o in zip(us, offers)),
                            MIN_TIME_MS),
                   t_rs=max(sum(u.t_rs for u, o in zip(us, offers) if o), MIN_TIME_MS),  # type: ignore[misc]
                   m_fs=sum(u.m_fs if o else u.m_f for u, o in zip(us, offers)))  # type: ignore[misc]
    return out


def _plain_first(layers: LayerProfile, lo: int, hi: int) -> bool:
    """Whether the stage of units ``[lo, hi)`` is a first stage the runtime does not split: one
    without all-to-all (see the module)."""
    return lo == 0 and not any(u.a_f or u.a_b for u in layers.units[lo:hi])


def _kept_input(layers: LayerProfile, lo: int) -> float:
    """What a fully checkpointed stage starting at unit ``lo`` keeps: its first unit's
    ``m_fc``, or where that reached the unit's m_f (capped there, ``StageMeasurement.cost``),
    its input's bytes and the generators' state (see the module)."""
    first = layers.units[lo]
    kept, state = first.m_fc, layers.checkpoint_state_bytes
    assert kept is not None
    if state is None or kept < first.m_f:
        return kept
    inputs = layers.units[lo - 1].output_bytes if lo else 0.0  # a first stage's input is the batch: not counted
    return max(kept, inputs + state)


def stage_profile(layers: LayerProfile, cut: Cut, data_parallel: tuple[int, float] | None = None,
                  sharded: bool = False, sharing: LaneSharing | None = None) -> Profile:
    """The ``zbsearch.profile`` of ``layers`` cut by ``cut``: what the solver, simulator and
    runtime take (pieces for the V, with their placement). ``data_parallel`` (replicas, GB/s
    per rank): each stage then ends the iteration with the all-reduce of its units' gradients,
    as many bytes as their parameters (``zbsearch.reductions``), expert parameters' only across
    each expert's copies (the replicas over ``layers.ep``); ``sharded`` (fully_shard over the
    replicas), a reduce-scatter, after gathering its parameters at the step's start; ``sharing``,
    how the lanes of ranks on one link slow each other."""
    cut.check(layers.num_units)
    bounds = cut.bounds
    identity = (layers.model or {}).get("identity") or {}
    source = {k: v for k, v in (layers.model or {}).items() if k not in ("identity", "stages")}
    model = {**source, "layers": layers.name, "cut": str(cut),
             # the unit fingerprints are not the stages': only the microbatch shapes are checked
             **({"identity": {"stages": [], "inputs": identity.get("inputs"), "target": identity.get("target")}}
                if identity else {})}
    prof = Profile(
        name=f"{layers.name}-{cut}",
        memory_unit="bytes",
        stages=[stage_cost(layers, lo, hi) for lo, hi in bounds],
        t_comm=[layers.comm(hi - 1) for _, hi in bounds[:-1]],
        t_action=layers.t_action,
        selective=layers.selective,
        placement=cut.stage_to_rank if cut.placement == "v" else None,
        microbatch_size=layers.microbatch_size,
        device=layers.device,
        torch=layers.torch,
        dtype=layers.dtype,
        mode=f"composed from the per-layer profile {layers.name!r}",
        model=model,
        mesh=ProfileMesh(pp=cut.num_ranks, ep=layers.ep) if layers.ep > 1 else None,
    )
    if data_parallel is None:
        return prof
    replicas = data_parallel[0]
    if replicas % layers.ep:
        raise ZbError(f"the expert-parallel degree {layers.ep} of {layers.name!r} does not divide the {replicas} "
                      "data-parallel replicas its expert groups lie in")
    grads = [sum(layers.units[u].param_bytes for u in range(lo, hi)) for lo, hi in bounds]
    experts = [sum(layers.units[u].expert_param_bytes for u in range(lo, hi)) for lo, hi in bounds]
    return with_reductions(prof, replicas, data_parallel[1], grads, sharded=sharded, expert_bytes=experts,
                           expert_replicas=replicas // layers.ep, sharing=sharing).model_copy(update={"name": prof.name})


def activation_need(layers: LayerProfile, cut: Cut, recompute: str = "none") -> list[float]:
    """Per rank, the least activation memory any schedule holds, recomputing as ``recompute``
    allows (``none``, ``auto``, ``full``; as ``zbsearch.solver.feasibility`` counts it).

    A microbatch's backward on a stage needs that stage's whole activations (m_f), and while it
    runs on the rank's k-th stage (in model order) the same microbatch still holds something on
    each of the rank's earlier stages: all of it without recomputation, else at least what the
    least keeping checkpointed forward keeps there. The sequential schedule holds exactly the
    largest of these sums."""
    out = []
    for lo_hi in _rank_bounds(cut):
        need, before = 0.0, 0.0
        for lo, hi in lo_hi:
            need = max(need, before + sum(u.m_f for u in layers.units[lo:hi]))
            before += least_kept(layers, lo, hi, recompute)
        out.append(need)
    return out


def least_kept(layers: LayerProfile, lo: int, hi: int, recompute: str = "none") -> float:
    """The least a microbatch keeps on the stage of units ``[lo, hi)`` between its forward and
    its backward: its activations, or what a checkpointed forward keeps where ``recompute``
    allows one that keeps less."""
    return min([sum(u.m_f for u in layers.units[lo:hi]), *_keeps(layers, lo, hi, recompute)])


def _keeps(layers: LayerProfile, lo: int, hi: int, recompute: str) -> list[float]:
    """What a checkpointed forward of the stage of units ``[lo, hi)`` keeps, for each way
    ``recompute`` allows (none: no way)."""
    if recompute == "none":
        return []
    got = _stage_recompute(layers, lo, hi)
    ways = [("m_fc", "t_r")] if recompute == "full" else [("m_fc", "t_r"), ("m_fs", "t_rs")]
    return [got[m] for m, t in ways if t in got]


def _rank_bounds(cut: Cut) -> list[list[tuple[int, int]]]:
    """Per rank, the unit ranges of its stages in model order."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(cut.num_ranks)]
    for b, r in zip(cut.bounds, cut.stage_to_rank):
        out[r].append(b)
    return out


def static_bytes(layers: LayerProfile, cut: Cut, optimizer: str, shard: int | None = None) -> list[float]:
    """Per rank, parameters, gradients and optimizer state (``zbsearch.planner.memory``), sharded
    over ``shard`` data-parallel ranks where given."""
    return rank_static_bytes(layers, cut.rank_units(), optimizer, shard)
