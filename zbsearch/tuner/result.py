"""The result of ``tune`` (``zbsearch.tune`` v1): every configuration searched or costed as a
baseline, ranked, the bound over the whole space, and the winner.

Each row is one configuration: its mesh, microbatch size and count, placement, what its
schedule may recompute, and what came of it. Status:

* ``costed``: scheduled and costed (``iteration_ms``, ``tokens_per_s``, ``bubble``, ``peak_bytes``);
* ``pruned``: its bound before planning already reached the best iteration found: it cannot win;
* ``does not fit``: no cut fits the memory (proven before planning, or by plan's pricing);
* ``no schedule``: plan found none within its time;
* ``not planned``: the time limit ran out before its turn;
* ``stopped``: it ran past its share of the time and was stopped.

``lower_bound_ms`` holds over every configuration searched and every cut and schedule of each:
the least of the best iteration and the bounds of the configurations that were not proven
unable to beat it. ``bound_before_planning_ms`` holds too, from what was known before any
configuration was planned (what pruned them). Read and write with ``load_tune`` / ``save_tune``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..formats.fileio import read_model, write_model
from .cluster import Cluster

__all__ = ["ConfigRow", "TuneResult", "STATUSES", "load_tune", "save_tune"]

Status = Literal["costed", "pruned", "does not fit", "no schedule", "not planned", "stopped"]
STATUSES: tuple[str, ...] = ("costed", "pruned", "does not fit", "no schedule", "not planned", "stopped")


class ConfigRow(BaseModel):
    """One configuration and its outcome (see the module)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="tune (searched), or the baseline's name")
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)
    microbatches: int = Field(ge=1, description="per replica and iteration")
    placement: Literal["one", "v", "looped"]
    recompute: str = Field(description="what the schedule may recompute: none, auto, full")
    sizes: str = Field(description="how the costs at this microbatch size were found: measured, interpolated, "
                                   "extrapolated, proportional")
    status: Status
    schedule: str | None = Field(None, description="the schedule's kind")
    iteration_ms: float | None = Field(None, description="the least of plans_ms")
    plans_ms: list[float] | None = Field(None, description=(
        "the iteration of each plan of this configuration, in order: the few that may win are planned again with "
        "more time"))
    bound_ms: float | None = Field(None, description="lower bound on every cut and schedule of this configuration")
    tokens_per_s: float | None = Field(None, description="global batch tokens per second (sequences where the "
                                                         "sequence length is unknown)")
    bubble: float | None = Field(None, description="share of the iteration the ranks spend on average not computing")
    peak_bytes: float | None = Field(None, description="the fullest rank's parameters, gradients, optimizer state "
                                                       "and peak activations")
    units_per_stage: list[int] | None = None
    layers_per_stage: list[int] | None = None
    recomputed: int | None = Field(None, description="forwards checkpointed and recomputed by the schedule")
    overlapped_pairs: int | None = Field(None, description=(
        "overlapped forward-backward pairs in the schedule, hiding expert-parallel all-to-all"))
    note: str | None = None
    time_s: float = 0.0


class TuneResult(BaseModel):
    """What ``tune`` found (see the module)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["zbsearch.tune"] = "zbsearch.tune"
    version: Literal[1] = 1
    layers: list[str] = Field(description="the per-layer profiles' names")
    measured_sizes: list[int]
    how_sizes_scale: str
    sizes: list[int] = Field(description="microbatch sizes searched")
    recompute: list[str] = Field(description="recomputation modes searched")
    cluster: Cluster
    tp: int
    ep: int = Field(1, ge=1, description=(
        "expert-parallel degree: each expert group is ep data-parallel peers of one pipeline rank (1: none; older "
        "files: 1)"))
    global_batch: int = Field(description="sequences per iteration, over all replicas")
    seq: int | None = Field(None, description="tokens per sequence (None: unknown, rates in sequences)")
    optimizer: str
    sharded: bool = Field(description="the optimizer state sharded over the replicas (ZeRO-1)")
    shard: bool = Field(False, description="the stages sharded over the replicas (fully_shard)")
    optimizer_step: str = Field(description="how the optimizer step is priced")
    time_limit_s: float
    time_s: float
    clock: Literal["wall", "work"] = Field("wall", description="what time_s, time_limit_s and the rows' time_s "
                                           "count: wall-clock seconds, or work in nominal seconds (tune "
                                           "--deterministic: the same inputs give the same result on any load)")
    rows: list[ConfigRow] = Field(description="costed rows first, fastest first; then the others")
    best: int | None = Field(None, description="index of the winner in rows")
    lower_bound_ms: float | None = None
    gap: float | None = None
    bound_before_planning_ms: float | None = Field(
        None, description="the bound over every configuration searched from what is known before any is planned: the "
                          "least of the configurations' bounds before planning (each up to the best baseline's "
                          "iteration) and the best baseline's iteration")
    gap_before_planning: float | None = Field(None, description="the winner's iteration over bound_before_planning_ms, "
                                                                "less 1")
    left_out: list[str] = Field(default_factory=list, description="meshes and sizes not in the space, and why")

    @property
    def winner(self) -> ConfigRow | None:
        """The fastest configuration costed."""
        return None if self.best is None else self.rows[self.best]

    def best_baseline(self) -> ConfigRow | None:
        """The fastest baseline costed."""
        rows = [r for r in self.rows if r.source != "tune" and r.iteration_ms is not None]
        return min(rows, key=lambda r: r.iteration_ms or 0.0, default=None)


def load_tune(path: str | os.PathLike) -> TuneResult:
    """The result in a ``zbsearch.tune`` file (one-line ZbError where it is not one)."""
    return read_model(TuneResult, path)


def save_tune(result: TuneResult, path: str | os.PathLike) -> None:
    """Write ``result`` as JSON to ``path`` (atomically)."""
    write_model(result, path)
