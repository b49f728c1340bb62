"""The ``partition`` section of a planned schedule: how the model's units were cut into stages.

``zbsearch plan`` writes a normal ``zbsearch.schedule`` whose profile is composed from a
per-layer profile (``zbsearch.layers``), plus this section: the units in model order, the unit
names of each stage (pieces in stage order for the V), the per-rank memory it counts against
the budget, the recomputation allowed, the lower bound that holds over every cut and schedule
searched, and the baselines solved beside it. Runners take the cut from here (``layers_per_stage``, ``units_per_stage``).
A section whose stages drop, repeat or reorder a unit does not load.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ZbError

__all__ = ["CutOutcome", "Partition", "check_names"]


class CutOutcome(BaseModel):
    """One cut solved at the plan's budget: the plan's own, or a baseline's."""

    model_config = ConfigDict(extra="forbid")

    name: str
    placement: Literal["one", "v"]
    units_per_stage: list[int]
    layers_per_stage: list[int]
    value: float | None = Field(None, description="the solver's objective (ms); None where no schedule fits")
    lower_bound: float | None = Field(None, description="the solver's bound for this cut under the budget (ms)")
    peak_bytes: list[float] | None = Field(None, description="per rank: static bytes plus the schedule's peak activations")
    recomputed: int = Field(0, description="recompute passes in the cut's schedule: forwards run checkpointed")
    overlapped_pairs: int = Field(0, description=(
        "overlapped forward-backward pairs in the cut's schedule (where the passes hold all-to-all)"))
    note: str | None = Field(None, description="why there is no value (over the budget, not applicable)")


class Partition(BaseModel):
    """How the units were cut (see the module). ``stages[s]``: the unit names of stage s."""

    model_config = ConfigDict(extra="forbid")

    layers: str = Field(description="the per-layer profile's name")
    units: list[str] = Field(min_length=1)
    kinds: list[Literal["embedding", "layer", "head", "unit"]]
    placement: Literal["one", "v"]
    stages: list[list[str]]
    optimizer: str
    shard: int | None = Field(None, ge=1, description=(
        "data-parallel ranks the stages are sharded over (fully_shard): static_bytes count each rank's share; "
        "None: whole on every rank"))
    budget_bytes: float | None = Field(None, description="per-rank budget (None: unlimited)")
    static_bytes: list[float] = Field(description="per rank: parameters, gradients and optimizer state")
    activation_bytes: list[float] = Field(description="per rank: the schedule's peak activation memory")
    objective: Literal["span", "makespan", "iteration"] = "span"
    recompute: Literal["none", "auto", "full"] = Field("none", description=(
        "the recomputation the plan allowed: every cut was solved and bounded with it (older files: none)"))
    value: float
    lower_bound: float = Field(description="holds over every cut of the placements searched and every schedule "
                               "within the budget, recomputing as the plan allowed (ms)")
    gap: float = Field(description="value / lower_bound - 1")
    placements_searched: list[Literal["one", "v"]]
    cuts_solved: int = 0
    cuts_bounded: int = Field(0, description="cuts whose bound was computed (each at least the lower bound)")
    exhaustive: bool = Field(False, description="every cut of the placements searched was bounded or solved")
    time_s: float = 0.0
    clock: Literal["wall", "work"] = Field("wall", description="what time_s counts: wall-clock seconds, or work in "
                                           "nominal seconds (plan --deterministic)")
    baselines: list[CutOutcome] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cut(self) -> Partition:
        if len(self.kinds) != len(self.units):
            raise ValueError(f"kinds has {len(self.kinds)} entries for {len(self.units)} units")
        problem = check_names(self.stages, self.units)
        if problem:
            raise ValueError(f"the cut is not the model's units in order: {problem}")
        ranks = len(self.stages) // (2 if self.placement == "v" else 1)
        if self.placement == "v" and len(self.stages) % 2:
            raise ValueError(f"a V cut has an even number of pieces, not {len(self.stages)}")
        for name in ("static_bytes", "activation_bytes"):
            if len(getattr(self, name)) != ranks:
                raise ValueError(f"{name} has {len(getattr(self, name))} values for {ranks} ranks")
        return self

    @property
    def units_per_stage(self) -> list[int]:
        """Units on each stage (pieces in stage order for the V)."""
        return [len(st) for st in self.stages]

    @property
    def layers_per_stage(self) -> list[int]:
        """Decoder layers (units of kind ``layer``) on each stage: what ``hf_stages`` and the
        built-in models take; the embedding is always on the first stage, the head on the last."""
        kind = dict(zip(self.units, self.kinds))
        return [sum(kind[n] == "layer" for n in st) for st in self.stages]

    def peak_bytes(self) -> list[float]:
        """Per rank: static bytes plus peak activations, what the budget bounds."""
        return [a + b for a, b in zip(self.static_bytes, self.activation_bytes)]


def check_names(stages: list[list[str]], units: list[str]) -> str | None:
    """Why ``stages`` (unit names per stage) is not ``units`` cut in order, in one line, or None
    when it is: the first unit dropped, repeated, reordered or unknown, or an empty stage."""
    empty = [s for s, st in enumerate(stages) if not st]
    if empty:
        return f"stage {empty[0]} holds no unit"
    flat = [(n, s) for s, st in enumerate(stages) for n in st]
    known = set(units)
    seen: set[str] = set()
    for i, (name, s) in enumerate(flat):
        if name not in known:
            return f"stage {s} names {name!r}, which is not a unit of the model"
        if name in seen:
            return f"unit {name!r} is repeated (again on stage {s})"
        seen.add(name)
        want = units[i] if i < len(units) else None
        if name != want:
            if want is not None and all(n != want for n, _ in flat):
                return f"unit {want!r} is dropped (stage {s} has {name!r} in its place)"
            return f"unit {name!r} is out of order on stage {s} (expected {want!r} there)"
    if len(flat) < len(units):
        return f"unit {units[len(flat)]!r} is dropped (the last stage ends before it)"
    return None


def refuse_names(stages: list[list[str]], units: list[str]) -> None:
    """Raise a one-line ZbError if ``stages`` is not ``units`` cut in order."""
    problem = check_names(stages, units)
    if problem:
        raise ZbError(f"the cut is not the model's units in order: {problem}")
