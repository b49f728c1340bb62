"""Per-layer profile format (``zbsearch.layers`` v1): the costs of each unit of a model.

A *unit* is the smallest piece a planner may put on a stage: the embedding, one decoder
layer, the final norm with the head and the loss (or, for a model of your own, each module
your build function returns). Each unit carries what a stage profile carries per stage (F, B,
W, fused BW and the forward before it, activation memory per pass), the bytes it sends to the
next unit, and what its parameters hold on the rank that runs it. Parameters that several units
use (an embedding tied to the LM head) are listed once under ``tied`` and named by the units that
use them, so that a rank holding two such units counts them once.

Recomputation, where measured (``zbsearch profile --per-layer --recompute``): each unit's
checkpointed forward time ``t_fc``, recompute time ``t_r`` and what it keeps ``m_fc`` (its input
and the random generators' state, ``checkpoint_state_bytes``), and selective recomputation's
``t_fs``, ``t_rs``, ``m_fs`` where a unit offers it, re-running the modules of the mode
``selective`` names (as a stage profile's); older files lack them: no recomputation.

For a mixture-of-experts model, each unit's expert-parallel all-to-all inside its passes
(``a_f`` inside F, ``a_b`` inside B, as a stage profile's: part of their times) and the
expert-parallel degree ``ep`` they were measured on; older files lack them: nothing to overlap.

Optionally ``t_action``: the runtime's own host time per action on a rank, outside the passes,
as a stage profile's (``zbsearch.formats.profile``). The per-layer profiler measures units on one
device, without the runtime's steps, so it comes from a stage profile measured under torchrun on
the same machine (``plan`` and ``tune``: ``--action-ms``); every stage a cut composes gets it
whole. Older files lack it: 0.

Link times between units on two ranks are ``t_comm`` where the profiler measured or estimated
one per boundary, else ``link``'s latency plus the boundary's bytes over its bandwidth.
``zbsearch.planner`` cuts the units into stages; ``zbsearch.planner.compose`` says how a
stage's costs follow from its units'.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ZbError
from .fileio import read_model, write_model
from .profile import MAX_MEMORY, MAX_TIME_MS, Measurement, SelectiveMode, StageCost, _finite_in

__all__ = ["UnitKind", "Unit", "TiedParams", "LinkEstimate", "LayerProfile", "load_layers", "save_layers"]

UnitKind = Literal["embedding", "layer", "head", "unit"]


class Unit(StageCost):
    """One unit's pass costs (``StageCost``, measured as a stage of its own) and its size.

    ``params`` and ``param_bytes`` are the trainable parameters the unit holds alone (tied ones
    are under the profile's ``tied``), ``frozen_bytes`` its parameters without gradient and its
    buffers; ``output_bytes`` what it sends to the next unit per microbatch (0 for the last).
    """

    name: str = Field(min_length=1)
    kind: UnitKind = "unit"
    output_bytes: float = Field(default=0, ge=0)
    params: int = Field(default=0, ge=0, description="trainable parameters held by this unit alone (elements)")
    param_bytes: float = Field(default=0, ge=0, description="their bytes as profiled (dtype as measured)")
    expert_params: int = Field(default=0, ge=0, description=(
        "of params, those of expert parameters (a mixture-of-experts layer's, as held on one rank of its expert group): "
        "reduced only across each expert's copies; older files: none"))
    expert_param_bytes: float = Field(default=0, ge=0, description="their bytes as profiled")
    frozen_bytes: float = Field(default=0, ge=0, description="parameters without gradient and buffers (bytes)")
    tied: list[str] = Field(default_factory=list, description="keys of the profile's tied parameters this unit uses")

    @field_validator("output_bytes", "param_bytes", "expert_param_bytes", "frozen_bytes")
    @classmethod
    def _bytes_range(cls, v: float) -> float:
        return _finite_in(v, MAX_MEMORY)

    @model_validator(mode="after")
    def _experts_within(self) -> Unit:
        if self.expert_params > self.params or self.expert_param_bytes > self.param_bytes:
            raise ValueError(f"unit {self.name!r}: its expert parameters exceed its parameters")
        return self


class TiedParams(BaseModel):
    """Trainable parameters that several units use (one copy per rank that runs any of them)."""

    model_config = ConfigDict(extra="forbid")

    params: int = Field(ge=0)
    param_bytes: float = Field(ge=0)


class LinkEstimate(BaseModel):
    """A link between two ranks as latency plus bytes over bandwidth."""

    model_config = ConfigDict(extra="allow")

    latency_ms: float = Field(ge=0)
    bandwidth_gb_s: float = Field(gt=0, description="1e9 bytes per second")
    method: str = "estimated"
    how: str | None = None

    def time_ms(self, nbytes: float) -> float:
        """One-way time of a message of ``nbytes`` bytes."""
        return self.latency_ms + nbytes / (self.bandwidth_gb_s * 1e6)


class LayerProfile(BaseModel):
    """A model's costs per unit, in order: what ``zbsearch plan`` cuts into stages.

    Measure one with ``zbsearch profile --per-layer`` (``zbsearch.profiler.profile_layers``),
    or generate one from a model's shape (``zbsearch.planner.analytic``); read and write it
    with ``load_layers`` and ``save_layers``.
    """

    model_config = ConfigDict(extra="allow")

    format: Literal["zbsearch.layers"] = "zbsearch.layers"
    version: Literal[1] = 1
    name: str
    time_unit: Literal["ms"] = "ms"
    memory_unit: Literal["bytes"] = "bytes"
    units: list[Unit] = Field(min_length=2)
    tied: dict[str, TiedParams] = Field(default_factory=dict)
    link: LinkEstimate
    t_comm: list[float] | None = Field(None, description="link time per unit boundary (ms); absent: from link")
    t_action: float | None = Field(None, description=(
        "the runtime's own host time per action on a rank (ms), outside the passes, as a stage profile's; every "
        "stage of a cut gets it whole; absent: 0"))
    checkpoint_state_bytes: float | None = Field(None, ge=0, description=(
        "bytes a checkpointed forward keeps besides its inputs (the random generators' state), where recomputation "
        "was measured; absent: what each unit's m_fc says"))
    selective: SelectiveMode | None = Field(None, description=(
        "which modules the units' selective recomputation (t_fs, t_rs, m_fs) re-runs: 'attention' (each layer's "
        "attention core) or 'mlp' (each layer's MLP), as a stage profile's; absent: not stated"))
    microbatch_size: int | None = Field(default=None, ge=1)
    ep: int = Field(1, ge=1, description=(
        "expert-parallel ranks the units' all-to-all times (a_f, a_b) hold for; a cut's stage profile records it in "
        "its mesh section (1: no expert parallelism)"))
    device: str | None = None
    torch: str | None = None
    dtype: str | None = None
    model: dict[str, Any] | None = None
    settings: dict[str, Any] | None = None
    measured: Measurement | None = None

    @field_validator("t_action")
    @classmethod
    def _action_range(cls, v: float | None) -> float | None:
        if v is not None and _finite_in(v, MAX_TIME_MS) < 0:
            raise ValueError("the host time per action must be >= 0")
        return v

    @field_validator("t_comm")
    @classmethod
    def _comm_range(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(_finite_in(x, MAX_TIME_MS) < 0 for x in v):
            raise ValueError("link times must be >= 0")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> LayerProfile:
        names = [u.name for u in self.units]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise ValueError(f"unit name {n!r} appears twice: units are named uniquely")
            seen.add(n)
        if self.t_comm is not None and len(self.t_comm) != len(self.units) - 1:
            raise ValueError(f"t_comm has {len(self.t_comm)} values for the {len(self.units) - 1} unit boundaries")
        for u in self.units:
            missing = [k for k in u.tied if k not in self.tied]
            if missing:
                raise ValueError(f"unit {u.name!r} names tied parameters {missing[0]!r} that 'tied' does not list")
        for i, u in enumerate(self.units):
            if u.deferred_first and i:
                raise ValueError(f"deferred_first is set on unit {i}: only the first unit's W runs its whole backward")
        return self

    @property
    def has_all_to_all(self) -> bool:
        """Whether some unit's passes hold all-to-all that an overlapped pair can hide."""
        return any(u.a_f > 0 or u.a_b > 0 for u in self.units)

    @property
    def num_units(self) -> int:
        """Units, in model order."""
        return len(self.units)

    @property
    def names(self) -> list[str]:
        """The units' names, in model order."""
        return [u.name for u in self.units]

    def comm(self, boundary: int) -> float:
        """Link time (ms) between unit ``boundary`` and the next when they are on two ranks."""
        if self.t_comm is not None:
            return self.t_comm[boundary]
        return self.link.time_ms(self.units[boundary].output_bytes)

    def __repr__(self) -> str:
        layers = sum(u.kind == "layer" for u in self.units)
        experts = f", ep={self.ep}" if self.ep > 1 else ""
        return f"LayerProfile({self.name!r}, units={self.num_units} ({layers} layers){experts}, memory_unit='bytes')"

    __str__ = __repr__


def load_layers(path: str | os.PathLike) -> LayerProfile:
    """The per-layer profile in a ``zbsearch.layers`` file.

    Raises:
        ZbError: no such file, or not a valid per-layer profile (one line naming the field).
    """
    p = os.fspath(path)
    if not os.path.exists(p) and not p.endswith(".json"):
        raise ZbError(f"{p}: no such per-layer profile file (make one with zbsearch profile --per-layer)")
    return read_model(LayerProfile, path)


def save_layers(layers: LayerProfile, path: str | os.PathLike) -> None:
    """Write ``layers`` as JSON to ``path`` (atomically)."""
    write_model(layers, path)
