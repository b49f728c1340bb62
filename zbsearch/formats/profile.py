"""Profile file format (``zbsearch.profile`` v1): measured per-stage costs.

A profile describes a model cut into pipeline stages: per stage, the time of F, B (input
gradient) and W (weight gradient), optionally of the fused backward BW (``t_bw``: one autograd
call for both, what GPipe/1F1B run; older files lack it and BW then costs t_b + t_w), optionally
of the forward of a microbatch whose backward is fused (``t_ff``: no split deferral to set up,
so a little cheaper than the F a split backward needs; older files lack it: t_f), whether the
first stage's W runs deferred (``deferred_first``: how its times were measured, see
``zbsearch.runtime.split``; older files lack it: one plain backward), and the
activation memory each pass allocates (m_f > 0)
or frees (m_b, m_w, normally negative). Optionally, what recomputation costs: a forward run
checkpointed (``t_fc``, keeping ``m_fc`` instead of m_f) and the recompute pass R that rebuilds
the rest before the backward (``t_r`` before a split backward, ``t_rf`` before a fused one, which
re-runs the plain forward: cheaper as t_ff is than t_f; older files lack t_rf: t_r); the same
for selective recomputation of some modules only (``t_fs``, ``m_fs``, ``t_rs``); older files
lack them: no recomputation on those stages. Which modules selective recomputation re-runs is
the profile's ``selective`` (``SELECTIVE_MODES``: each layer's attention core, or its MLP): the
runtime runs the mode the profile's costs describe; older files lack it (not stated).
What F allocates must be freed by B and W, so the three memory deltas sum to zero per stage; a
profile that breaks this is rejected because it would make every memory prediction drift with
the number of microbatches.
Optionally, for a mixture-of-experts model, the expert-parallel all-to-all inside the passes
(``a_f``: dispatch and combine inside F, already counted in t_f; ``a_b``: their mirrors inside
B and inside the fused backward; W has none, R repeats the forward's), which a rank can hide by
running a forward and another microbatch's backward as one overlapped pair
(``zbsearch.costs``), with the expert-parallel degree they were measured on in the ``mesh``
section (``ep``; files that kept it at the top level load with it moved there); older files
lack them: nothing to overlap. Optionally, per stage, how much of what a pair hides still costs
time (``pair_exposed``, measured by the profiler on the expert group; older files lack it: 0).
Per boundary between stages: ``t_comm``, the link's latency (it occupies neither rank), and
optionally ``t_send`` / ``t_recv``, the host time a message takes from the rank at each end
(older files lack them: 0).
Optionally ``t_action``: the runtime's own host time per action on a rank, outside the passes
(handing outputs on, posting receives, bookkeeping between two actions), measured in the
runtime's steps; it does not shrink when a stage is cut into pieces (older files lack it: 0).
Optionally, the mesh the costs hold for (``mesh``, ``zbsearch.formats.mesh``): at
tensor-parallel degree ``tp`` every time and byte is one rank's of the stage's tensor-parallel
group; older files lack it: one pipeline at degree 1.
"""

from __future__ import annotations

import math
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ZbError
from ..tolerances import ABS_TOL
from .fileio import read_model, write_model
from .mesh import ProfileMesh
from .spread import Quartiles

__all__ = [
    "SELECTIVE_MODES", "SelectiveMode", "StageCost", "Quartiles", "WayNotTaken", "StageSpread", "Measurement", "Links", "Profile",
    "ProfileMesh",
    "load_profile", "save_profile", "resolve_profile", "BUNDLED_PROFILES", "profile_misfit", "pass_time_fields",
]

# What selective recomputation re-runs: a stage's modules declared for it in one of these modes
# (``zbsearch.runtime.selective``), and the mode a profile's selective costs describe.
SelectiveMode = Literal["attention", "mlp"]
SELECTIVE_MODES: dict[str, str] = {
    "attention": "each layer's attention core (QK^T, softmax, dropout, the weighted sum of V; not the projections): "
                 "Megatron's selective recomputation",
    "mlp": "each layer's MLP (or mixture of experts)",
}

# Relative tolerance for "m_f + m_b + m_w ~ 0" (measured allocator deltas are noisy).
_MEMORY_BALANCE_RTOL = 0.02
# Largest magnitudes accepted: a pass of 11 days, a petabyte per microbatch. Far beyond any real
# model, and small enough that sums over millions of passes stay finite and exact enough.
MAX_TIME_MS = 1e9
MAX_MEMORY = 1e15
# Measured times are floored here: a B with nothing to do (a first stage) can read 0 on a coarse
# clock, and a profile's times are positive.
MIN_TIME_MS = 1e-6
# Largest slowdown accepted from a reduction running beside the passes: a pass 100 times slower
# says the measurement went wrong, not that the links contend with compute.
MAX_SLOWDOWN = 100.0


def _finite_in(v: float, limit: float) -> float:
    if not math.isfinite(v):
        raise ValueError("must be a finite number")
    if abs(v) > limit:
        raise ValueError(f"{v:g} is out of range (magnitude at most {limit:g})")
    return v


class StageCost(BaseModel):
    """One stage's pass times and memory deltas; extra fields (measurement details) are kept.

    Fields named ``t_*`` are pass times in ms and ``m_*`` memory deltas: code that treats every
    pass time alike (pooling rounds, drift) finds them by that prefix (``pass_time_fields``).
    """

    model_config = ConfigDict(extra="allow")

    t_f: float = Field(gt=0, description="forward time")
    t_b: float = Field(gt=0, description="input-gradient (B) time")
    t_w: float = Field(ge=0, description="weight-gradient (W) time")
    m_f: float = Field(ge=0, description="activation memory allocated by F (M_B)")
    m_b: float = Field(description="memory change of B (normally negative)")
    m_w: float = Field(description="memory change of W (normally negative)")
    t_bw: float | None = Field(default=None, gt=0, description="fused backward (BW) time; absent: t_b + t_w")
    t_ff: float | None = Field(default=None, gt=0, description="forward time before a fused backward; absent: t_f")
    t_fc: float | None = Field(default=None, gt=0, description=(
        "forward time when checkpointed for full recomputation (keeps only what recomputation needs); absent: t_f"))
    t_r: float | None = Field(default=None, gt=0, description=(
        "full recomputation (R) time: re-running the stage's forward before its backward; absent: not measured"))
    t_rf: float | None = Field(default=None, gt=0, description=(
        "full recomputation (R) time before a fused backward: the forward re-run as a plain one, without "
        "the split's deferral; absent: t_r"))
    m_fc: float | None = Field(default=None, ge=0, description=(
        "memory a checkpointed forward keeps (the stage input, RNG state); R allocates m_f - m_fc"))
    t_fs: float | None = Field(default=None, gt=0, description=(
        "forward time when checkpointed for selective recomputation; absent: t_f"))
    t_rs: float | None = Field(default=None, gt=0, description=(
        "selective recomputation (RS) time: re-running the selected modules only; absent: not offered"))
    m_fs: float | None = Field(default=None, ge=0, description=(
        "memory a forward checkpointed for selective recomputation keeps; RS allocates m_f - m_fs"))
    t_reduce: float | None = Field(default=None, ge=0, description=(
        "reducing the stage's gradients across its data-parallel replicas (all-reduce, or reduce-scatter where "
        "sharded), started when the stage's last W or BW of the step has run on its rank; absent: no reduction"))
    t_gather: float | None = Field(default=None, ge=0, description=(
        "gathering the stage's sharded parameters (all-gather, fully_shard) at the step's start, before its first "
        "pass; absent: none"))
    t_opt: float | None = Field(default=None, ge=0, description=(
        "the optimizer step of the stage's parameters, after the rank's passes and reductions; absent: 0"))
    reduce_slowdown: float | None = Field(default=None, ge=1, le=MAX_SLOWDOWN, description=(
        "how much slower the rank's passes run while the stage's reduction (or gather) runs on its lane: a pass "
        "that takes t alone takes reduce_slowdown * t beside it (zbsearch.reductions); absent: 1, no slowdown"))
    reduce_stretch: float | None = Field(default=None, ge=1, le=MAX_SLOWDOWN, description=(
        "how much slower the stage's reduction (or gather) runs on its rank's lane while a pass of the rank computes "
        "beside it: a run that takes t alone moves at 1 / reduce_stretch of its speed for as long as the rank "
        "computes (zbsearch.reductions); absent: 1, at its own speed"))
    a_f: float = Field(default=0.0, ge=0, description=(
        "expert-parallel all-to-all time (dispatch and combine) inside the forward, part of t_f (and of t_ff, t_fc "
        "and t_r, which repeat it): what an overlapped pair can hide behind another pass's compute; 0: none"))
    a_b: float = Field(default=0.0, ge=0, description=(
        "expert-parallel all-to-all time inside the input-gradient pass B and the fused backward, part of t_b and "
        "t_bw (W has none: expert weight gradients are local); 0: none"))
    pair_exposed: float | None = Field(default=None, ge=0, le=1, description=(
        "share of the all-to-all an overlapped pair hides behind the other pass's compute that still costs the rank "
        "time (the host's cores, memory bandwidth or the wake-up of a waiting peer), measured on the expert group: "
        "0 hides it all, 1 hides nothing (zbsearch.costs); absent: 0"))
    deferred_first: bool = Field(default=False, description=(
        "a first stage whose W (its whole backward) runs the split's fast path, deferred Linear weight "
        "gradients, rather than one plain backward: measured faster by the profiler; the runtime follows it"))

    @field_validator("t_f", "t_b", "t_w", "t_bw", "t_ff", "t_fc", "t_r", "t_rf", "t_fs", "t_rs", "t_reduce", "t_gather", "t_opt")
    @classmethod
    def _time_range(cls, v: float | None) -> float | None:
        return None if v is None else _finite_in(v, MAX_TIME_MS)

    @field_validator("a_f", "a_b")
    @classmethod
    def _comm_range(cls, v: float) -> float:
        return _finite_in(v, MAX_TIME_MS)

    @field_validator("m_f", "m_b", "m_w", "m_fc", "m_fs")
    @classmethod
    def _memory_range(cls, v: float | None) -> float | None:
        return None if v is None else _finite_in(v, MAX_MEMORY)

    @property
    def fused_backward(self) -> float:
        """What a BW pass costs: measured, or the split's cost where the profile has no t_bw."""
        return self.t_b + self.t_w if self.t_bw is None else self.t_bw

    @property
    def fused_forward(self) -> float:
        """What the F of a microbatch with a fused backward costs: measured, or t_f where the
        profile has no t_ff."""
        return self.t_f if self.t_ff is None else self.t_ff

    @property
    def fused_recompute(self) -> float | None:
        """What R costs before a fused backward: measured, or t_r where the profile has no
        t_rf (None: no full recomputation)."""
        return self.t_r if self.t_rf is None else self.t_rf

    def recompute(self, selective: bool = False) -> tuple[float, float, float] | None:
        """(checkpointed F time, recompute time, memory the checkpointed F keeps) of full (or
        ``selective``) recomputation, None where the profile does not offer it."""
        t_fc, t_r, m_fc = (self.t_fs, self.t_rs, self.m_fs) if selective else (self.t_fc, self.t_r, self.m_fc)
        if t_r is None or m_fc is None:
            return None
        return (self.t_f if t_fc is None else t_fc), t_r, m_fc

    @model_validator(mode="after")
    def _recompute_fields(self) -> StageCost:
        for what, (t_fc, t_r, m_fc) in (("full", ("t_fc", "t_r", "m_fc")), ("selective", ("t_fs", "t_rs", "m_fs"))):
            given = [getattr(self, k) is not None for k in (t_r, m_fc)]
            if any(given) and not all(given):
                raise ValueError(f"{what} recomputation needs both {t_r} and {m_fc}")
            if getattr(self, t_fc) is not None and not all(given):
                raise ValueError(f"{t_fc} is given without {t_r} and {m_fc}")
            kept = getattr(self, m_fc)
            if kept is not None and kept > self.m_f * (1 + _MEMORY_BALANCE_RTOL) + ABS_TOL:
                raise ValueError(f"{m_fc} = {kept:g} is more than m_f = {self.m_f:g}: a checkpointed forward keeps "
                                 f"part of what a plain one does")
        if self.t_rf is not None and self.t_r is None:
            raise ValueError("t_rf is given without t_r and m_fc")
        return self

    @model_validator(mode="after")
    def _all_to_all_inside(self) -> StageCost:
        """The all-to-all is part of the passes that run it, so it fits in each of them."""
        tol = ABS_TOL + 1e-9 * max(self.a_f, self.a_b)
        for name, a, passes in (("a_f", self.a_f, ("t_f", "t_ff", "t_fc", "t_r", "t_rf")), ("a_b", self.a_b, ("t_b", "t_bw"))):
            for t in passes:
                v = getattr(self, t)
                if v is not None and a > v + tol:
                    raise ValueError(f"{name} = {a:g} is more than {t} = {v:g}: the all-to-all is part of the pass's time")
        return self

    @model_validator(mode="after")
    def _balanced(self) -> StageCost:
        total = self.m_f + self.m_b + self.m_w
        if abs(total) > _MEMORY_BALANCE_RTOL * abs(self.m_f) + ABS_TOL:
            raise ValueError(
                f"memory deltas do not balance: m_f + m_b + m_w = {total:g} "
                f"(what F allocates must be freed by B and W)"
            )
        return self


# a stage's times that are no pass: the iteration's end, after the passes (``reductions``)
ITERATION_FIELDS = ("t_reduce", "t_gather", "t_opt")


def pass_time_fields() -> tuple[str, ...]:
    """The names of ``StageCost``'s pass times, the required ones first (t_f, t_b, t_w, ...)."""
    fields = StageCost.model_fields
    times = [name for name in fields if name.startswith("t_") and name not in ITERATION_FIELDS]
    return tuple(sorted(times, key=lambda name: not fields[name].is_required()))


class WayNotTaken(BaseModel):
    """A first stage's passes timed the other way its W can run (``StageCost.deferred_first``)."""

    w: Literal["plain", "deferred"]
    t_f: Quartiles
    t_b: Quartiles
    t_w: Quartiles


class StageSpread(BaseModel):
    """How one stage's passes were measured: the spread of the repeats, what it sends on."""

    model_config = ConfigDict(extra="allow")

    t_f: Quartiles
    t_b: Quartiles
    t_w: Quartiles
    t_bw: Quartiles | None = None
    t_ff: Quartiles | None = None
    t_fc: Quartiles | None = None
    t_r: Quartiles | None = None
    t_fs: Quartiles | None = None
    t_rs: Quartiles | None = None
    t_rf: Quartiles | None = None
    in_step: dict[str, Quartiles] | None = Field(default=None, description=(
        "the same passes timed inside steps of the runtime (t_f, t_b, t_w, t_ff, t_bw; zbsearch.profiler.in_step), "
        "whose means are the stage's costs; the fields above are the repetitions'; older files lack it"))
    memory_residual: float | None = None
    output_bytes: int | None = None
    not_taken: WayNotTaken | None = None


class Measurement(BaseModel):
    """What the profiler measured with, and the raw figures behind the stage costs."""

    model_config = ConfigDict(extra="allow")

    timing: str | None = None
    memory: str | None = None
    boundary_bytes: list[int] = Field(default_factory=list, description="bytes each stage sends to the next")
    stages: list[StageSpread] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list, description="why the measurement may be disturbed")


class Links(BaseModel):
    """How ``t_comm`` was obtained: measured between ranks or estimated from a link model."""

    model_config = ConfigDict(extra="allow")

    method: str
    how: str | None = None
    latency_ms: float | None = None
    bandwidth_gb_s: float | None = None
    devices: list[str] | None = None
    one_way_ms: list[Quartiles | None] | None = Field(
        default=None, description="measured link times per boundary; None between two pieces of one rank (no link)")


class LaneSharing(BaseModel):
    """How the reduction lanes of different pipeline ranks slow each other on a link they share
    (a node's NICs, a host's cores; ``zbsearch.reductions.share_rate``): while k runs (reductions
    or gathers) of ranks on one link are under way, each moves at 1 / (1 + share (k - 1)) of its
    speed alone. Measured by ``zbsearch profile --dp`` as every rank's reductions at once against
    each alone. Absent (older files): every lane at full speed."""

    model_config = ConfigDict(extra="allow")

    version: Literal[1] = 1
    share: float = Field(ge=0, le=MAX_SLOWDOWN, description=(
        "0: lanes on one link never slow each other; 1: k runs at once split the link evenly; above 1: worse than an even split"))
    ranks_per_link: int | None = Field(default=None, ge=1, description=(
        "consecutive pipeline ranks sharing one link (a node's); absent: every rank of the pipeline on one link"))
    measured: Quartiles | None = Field(default=None, description=(
        "where measured: the spread of the share over the timed rounds; share is its median"))
    alone_ms: list[Quartiles] | None = Field(default=None, description="where measured: per stage, its reduction timed alone")
    together_ms: list[Quartiles] | None = Field(default=None, description=(
        "where measured: per stage, its reduction timed with every rank's reductions at once"))


class DataParallel(BaseModel):
    """How the stages' ``t_reduce`` (and, sharded, ``t_gather``) were found: the replicas each
    stage's gradients are reduced across, whether the data parallelism is sharded, and measured
    on a real group or computed from the gradient bytes and a bandwidth. The fields after
    ``grad_bytes`` are written where the reductions were measured (older files lack them, and
    ``gather_ms`` where they were not sharded)."""

    model_config = ConfigDict(extra="allow")

    replicas: int = Field(ge=1)
    sharded: bool = False
    how: Literal["measured", "bandwidth"] = "bandwidth"
    bandwidth_gbs: float | None = Field(default=None, gt=0, description="GB/s per rank (how = bandwidth)")
    grad_bytes: list[float] | None = Field(default=None, description="gradient bytes per stage")
    expert_bytes: list[float] | None = Field(default=None, description=(
        "how = bandwidth: per stage, the part of grad_bytes that is expert parameters', reduced across each expert's "
        "expert_replicas copies only (absent: no expert parameters)"))
    expert_replicas: int | None = Field(default=None, ge=1, description=(
        "the copies of each expert its gradients are reduced across: the replicas over the expert-parallel degree"))
    group: Literal["local", "torchrun"] | None = Field(default=None, description=(
        "how = measured: where, on local processes of the profiling machine (its loopback) or on the replicas "
        "torchrun started"))
    backend: str | None = Field(default=None, description="how = measured: the process group's backend (gloo, nccl)")
    reduce_ms: list[Quartiles] | None = Field(default=None, description=(
        "how = measured: per stage, the spread of its timed reductions; t_reduce is their median"))
    slowdown: list[Quartiles | None] | None = Field(default=None, description=(
        "how = measured: per stage, the spread of the factor by which its reduction (sharded: its gathers and "
        "reduce-scatters) running beside a pass slowed the pass (the pass's time beside them over its time alone; "
        "None: not measured); reduce_slowdown is the median, at least 1"))
    stretch: list[Quartiles | None] | None = Field(default=None, description=(
        "how = measured: per stage, the spread of the factor by which the stage's pass running beside its reduction "
        "slowed the reduction, from the same rounds as slowdown (the reduction's time beside the pass over its time "
        "alone; None: not measured); reduce_stretch is the median, at least 1; absent (older files): not measured"))
    gather_ms: list[Quartiles] | None = Field(default=None, description=(
        "how = measured, sharded: per stage, the spread of its timed parameter gathers; t_gather is their median"))
    sharing: LaneSharing | None = Field(default=None, description=(
        "how the lanes of ranks on one link slow each other (zbsearch.reductions.share_rate); absent: not at all"))


class Profile(BaseModel):
    """A model's measured costs per pipeline stage: what schedules are built from.

    ``stages[s]`` holds stage s's pass times (ms) and activation memory deltas
    (``memory_unit``: bytes, or activations where M_B = 1), ``t_comm`` the link time at each
    boundary. The profiler also records where and how it measured (device, settings, the spread
    of every pass); other top-level fields are kept as they are.

    Load one with ``zbsearch.load_profile`` (a file or a bundled name such as ``"1.5b-m24"``),
    measure one with ``zbsearch.profiler.profile_model``, write one with ``save_profile``
    (the ``zbsearch.profile`` v1 format).
    """

    model_config = ConfigDict(extra="allow")

    format: Literal["zbsearch.profile"] = "zbsearch.profile"
    version: Literal[1] = 1
    name: str
    time_unit: Literal["ms"] = "ms"
    memory_unit: Literal["bytes", "activations"]
    stages: list[StageCost] = Field(min_length=1)
    t_comm: float | list[float] = 0.0
    selective: SelectiveMode | None = Field(None, description=(
        "which modules the stages' selective recomputation (t_fs, t_rs, m_fs) re-runs, as SELECTIVE_MODES names them: "
        "'attention' (each layer's attention core) or 'mlp' (each layer's MLP); the runtime runs this mode; "
        "absent: not stated (older files)"))
    # Host time a message costs the rank at each end of a link between ranks, per boundary (ms):
    # the sender's call handing it to the link (``t_send``) and the receiver's call posting its
    # receive (``t_recv``), measured while both ranks compute, as in a pipeline's steady state.
    # Unlike t_comm this time is the rank's own: it delays the rank's next pass. Absent: 0.
    t_send: float | list[float] | None = None
    t_recv: float | list[float] | None = None
    # The runtime's own host time per action (ms), outside the passes: between one action's end
    # and the next one's start on a rank whose inputs are in. Absent: 0.
    t_action: float | None = None
    memory_capacity: list[float] | None = None
    # written by the profiler; absent from hand-written and paper profiles
    device: str | None = None
    torch: str | None = None
    dtype: str | None = None
    mode: str | None = None
    model: dict[str, Any] | None = Field(None, description="the model's settings (layers, hidden, ...)")
    settings: dict[str, Any] | None = Field(None, description="the profiler's settings")
    links: Links | None = None
    measured: Measurement | None = None
    # The stages are pieces measured for this placement (piece -> rank), e.g. 2P pieces of a V
    # placement on P ranks: schedules with as many stages use their costs as they are. Without
    # it each stage is one rank's, and finer schedules split every stage evenly (costs).
    placement: list[int] | None = None
    # Sequences per microbatch the times were measured with (dim 0 of the microbatch); the
    # runtime refuses microbatches of another size, whose times the schedule did not plan for.
    microbatch_size: int | None = Field(default=None, ge=1)
    # where the stages record t_reduce: the data parallelism the reductions were found for
    data_parallel: DataParallel | None = None
    mesh: ProfileMesh | None = Field(None, description=(
        "the mesh the costs hold for (zbsearch.formats.mesh): its sizes, the tensor-parallel degree the passes were "
        "measured at and its link, the expert-parallel degree of a_f and a_b; absent: one pipeline at tensor-parallel "
        "degree 1 without expert parallelism (see made_for)"))

    @property
    def ep(self) -> int:
        """The expert-parallel degree the stages' all-to-all times hold for (the mesh's ``ep``)."""
        return self.made_for.ep

    @property
    def has_all_to_all(self) -> bool:
        """Whether some stage's passes hold all-to-all that an overlapped pair can hide."""
        return any(c.a_f > 0 or c.a_b > 0 for c in self.stages)

    @property
    def made_for(self) -> ProfileMesh:
        """The mesh the costs hold for: the ``mesh`` section, or, in a profile without one, one
        pipeline of ``num_ranks`` at tensor-parallel degree 1 with the replicas of its
        ``data_parallel`` section (sharded or not)."""
        if self.mesh is not None:
            return self.mesh
        dp = self.data_parallel
        replicas = 1 if dp is None else dp.replicas
        sharded = dp is not None and dp.sharded
        return ProfileMesh(pp=self.num_ranks, dp_replicate=1 if sharded else replicas, dp_shard=replicas if sharded else 1)

    @model_validator(mode="wrap")
    @classmethod
    def _ep_into_mesh(cls, data: Any, handler: Any) -> Profile:
        """Files (and callers) that give the expert-parallel degree as a top-level ``ep``, where
        it was kept before the mesh section held it: the profile has it in ``mesh.ep``."""
        if not isinstance(data, dict) or "ep" not in data:
            return handler(data)
        data = dict(data)
        ep = data.pop("ep")
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"ep must be a whole number of at least 1 (expert-parallel ranks), not {ep!r}")
        prof = handler(data)
        if ep == 1 or prof.made_for.ep == ep:
            return prof
        if prof.mesh is not None and prof.mesh.ep != 1:
            raise ValueError(f"ep {ep} at the top level disagrees with mesh.ep {prof.mesh.ep}: give it once, in the mesh")
        prof.mesh = prof.made_for.model_copy(update={"ep": ep})
        return prof

    @model_validator(mode="after")
    def _mesh_agrees(self) -> Profile:
        mesh = self.mesh
        if mesh is None:
            return self
        if mesh.pp != self.num_ranks:
            raise ValueError(f"mesh.pp is {mesh.pp} but the profile's stages are on {self.num_ranks} pipeline ranks")
        dp = self.data_parallel
        replicas, sharded = (1, False) if dp is None else (dp.replicas, dp.sharded)
        if mesh.dp_replicate * mesh.dp_shard != replicas or (sharded and replicas > 1 and mesh.dp_replicate != 1):
            raise ValueError(f"mesh dp_replicate {mesh.dp_replicate} x dp_shard {mesh.dp_shard} does not match the "
                             f"data_parallel section's {replicas} {'sharded' if sharded else 'replicated'} replicas")
        return self

    @property
    def has_reductions(self) -> bool:
        """Whether the iteration has work beside the passes (a stage's reduction, gather or optimizer step)."""
        return any((c.t_reduce or 0) > 0 or (c.t_gather or 0) > 0 or (c.t_opt or 0) > 0 for c in self.stages)

    @field_validator("t_comm", "t_send", "t_recv", "t_action")
    @classmethod
    def _comm_nonneg(cls, v: float | list[float] | None) -> float | list[float] | None:
        values = [] if v is None else v if isinstance(v, list) else [v]
        if any(_finite_in(x, MAX_TIME_MS) < 0 for x in values):
            raise ValueError("communication times must be >= 0")
        return v

    @field_validator("memory_capacity")
    @classmethod
    def _capacity_pos(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(_finite_in(x, MAX_MEMORY) <= 0 for x in v):
            raise ValueError("memory capacities must be > 0")
        return v

    @model_validator(mode="after")
    def _deferred_first_only(self) -> Profile:
        later = [i for i, st in enumerate(self.stages) if i and st.deferred_first]
        if later:
            raise ValueError(f"deferred_first is set on stage {later[0]}: only the first stage's W runs its whole backward")
        return self

    @model_validator(mode="after")
    def _comm_len(self) -> Profile:
        for name in ("t_comm", "t_send", "t_recv"):
            v = getattr(self, name)
            if isinstance(v, list) and len(v) != len(self.stages) - 1:
                raise ValueError(
                    f"{name} has {len(v)} values but {len(self.stages)} stages have {len(self.stages) - 1} boundaries"
                )
        if self.memory_capacity is not None and len(self.memory_capacity) != len(self.stages):
            raise ValueError(
                f"memory_capacity has {len(self.memory_capacity)} values for {len(self.stages)} stages "
                f"(one per rank, each rank holding one stage)"
            )
        return self

    @model_validator(mode="after")
    def _placement(self) -> Profile:
        pl = self.placement
        if pl is None:
            return self
        if len(pl) != len(self.stages):
            raise ValueError(f"placement has {len(pl)} entries for {len(self.stages)} stages")
        ranks = max(pl) + 1
        if min(pl) < 0 or sorted(set(pl)) != list(range(ranks)) or any(pl.count(r) != len(pl) // ranks for r in range(ranks)):
            raise ValueError(f"placement {pl} must give ranks 0..R-1 the same number of stages each")
        return self

    @property
    def num_stages(self) -> int:
        """Stages measured (pieces, where the profile has a placement)."""
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Ranks the profile describes: the placement's, else one per stage."""
        return self.num_stages if self.placement is None else max(self.placement) + 1

    @property
    def chunks(self) -> int:
        """Stages per rank in the measured placement (1 without one)."""
        return self.num_stages // self.num_ranks

    def comm(self, boundary: int, kind: str = "t_comm") -> float:
        """Time to pass a tensor across the boundary between stage ``boundary`` and the next
        (``kind``: the link's ``t_comm``, or the host time ``t_send`` / ``t_recv`` at its ends)."""
        v = getattr(self, kind)
        return 0.0 if v is None else v[boundary] if isinstance(v, list) else v

    def mean_comm(self, kind: str = "t_comm") -> float:
        """The mean of ``comm`` over all boundaries: what a boundary inside a profile stage costs
        when a schedule cuts the stage finer."""
        v = getattr(self, kind)
        if not isinstance(v, list):
            return v or 0.0
        return sum(v) / len(v) if v else 0.0

    def __repr__(self) -> str:
        stages = f"stages={self.num_stages}"
        if self.placement is not None:
            stages += f" (pieces on {self.num_ranks} ranks)"
        n = self.num_stages
        means = "/".join(f"{sum(getattr(st, t) for st in self.stages) / n:.4g}" for t in ("t_f", "t_b", "t_w"))
        return f"Profile({self.name!r}, {stages}, memory_unit={self.memory_unit!r}, mean F/B/W {means} ms)"

    __str__ = __repr__

    def compute_only(self) -> Profile:
        """This profile without the host time of messages (``t_send``, ``t_recv``) and of the
        runtime's actions (``t_action``): what the passes themselves take, as a runtime trace
        times them and emulated stages sleep."""
        return self.model_copy(update={"t_send": None, "t_recv": None, "t_action": None})


# Shipped inside the package (package data), so a wheel install has them too.
BUNDLED_PROFILES = Path(str(resources.files("zbsearch") / "profiles"))


def load_profile(name_or_path: str | os.PathLike) -> Profile:
    """A profile from a JSON file, or by name from the profiles bundled with zbsearch
    (``load_profile("1.5b-m24")``), as every command's ``--profile`` takes it.

    Raises:
        ZbError: no such file or bundled name, or a file that is not a valid profile.
    """
    p = Path(name_or_path)
    if p.exists() or p.suffix == ".json" or len(p.parts) > 1:
        return read_model(Profile, p)
    bundled = sorted(BUNDLED_PROFILES.rglob("*.json"))
    matches = [x for x in bundled if x.stem == p.name]  # an exact name, never a glob
    if not matches:
        known = ", ".join(sorted(x.stem for x in bundled)) or "none"
        raise ZbError(f"no profile file {str(p)!r} and no bundled profile of that name (bundled: {known})")
    return read_model(Profile, matches[0])


# the name the command line uses for load_profile
resolve_profile = load_profile


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` as JSON to ``path`` (atomically: a failed write leaves no partial file)."""
    write_model(profile, path)


def profile_misfit(profile_stages: int, num_stages: int, num_ranks: int) -> str | None:
    """Why a profile of ``profile_stages`` stages cannot cost a schedule, or None if it can.

    Costs come from splitting each profile stage into equal consecutive virtual stages
    (``CostModel``). Two splits mean what the schedule was built for: one profile stage per
    virtual stage, or one per rank (how every builder and the solver place a P-stage profile
    on P ranks, each rank's stage cut into its chunks). Any other divisor would also split
    evenly, but it would put one profile stage's costs on several ranks, a placement the
    schedule was never built for, and silently report another model's times.
    """
    if profile_stages in (num_stages, num_ranks):
        return None
    ranks = f" or {num_ranks} (one per rank)" if num_ranks != num_stages else ""
    return (f"profile has {profile_stages} stages but this schedule of {num_stages} stages on {num_ranks} ranks "
            f"needs {num_stages} (one per stage){ranks}")
