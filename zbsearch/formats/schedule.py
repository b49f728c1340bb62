"""Schedule file format (``zbsearch.schedule`` v1): per-rank action lists plus what they predict.

A schedule is data, not code: each rank's list says in which order that rank executes its
passes. Everything else (timeline, bubble, memory) is derived from the list and a profile by
the simulator, and stored under ``predicted`` for people and tools that do not simulate.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from ..actions import PAIR_SEP, Action, Op, parse_action, parse_row, row_text
from ..errors import ZbError
from .fileio import read_model, write_model
from .partition import Partition
from .profile import Profile, profile_misfit

__all__ = ["Objective", "BoundCovers", "bound_covers", "Predicted", "SolverInfo", "Schedule", "pairs_problem", "load_schedule",
           "save_schedule"]

Objective = Literal["span", "makespan", "iteration"]
BoundCovers = Literal["no-recompute", "any-recompute", "full-recompute"]


_COVERS: dict[str, BoundCovers] = {"none": "no-recompute", "auto": "any-recompute", "full": "full-recompute"}


def bound_covers(recompute: str) -> BoundCovers:
    """The schedules a solve's bound covers, by the recomputation it could choose: the bound is
    computed on costs that offer only that recomputation (``solver.Problem``)."""
    return _COVERS[recompute]


class Predicted(BaseModel):
    """What the simulator predicts for the schedule on its profile."""

    model_config = ConfigDict(extra="forbid")

    makespan: float
    span: list[float]
    bubble_rate: float
    peak_memory: list[float]
    lower_bound: float = Field(description="bound_any_memory: lower bound on max(span) over every schedule of this "
                               "profile and placement at any memory (memory-blind; printed by schedule, simulate, compare)")
    lower_bound_makespan: float | None = Field(None, description="bound_any_memory on the makespan")
    bubble_rate_makespan: float | None = Field(None, description="bubble rate with the makespan as the period")
    iteration: list[float] | None = Field(None, description="per rank, its iteration where the profile ends it with "
                                          "reductions and optimizer steps (zbsearch.reductions); absent: its span")


class SolverInfo(BaseModel):
    """How the solver found the schedule (the ``solver`` section of a solved schedule)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["heuristic", "heuristic+milp"]
    construction: str
    objective: Objective
    status: Literal["optimal", "feasible", "time_limit"]
    value: float
    lower_bound: float = Field(description="bound_under_limit: lower bound on the objective over every schedule "
                               "of the class bound_covers names within the memory limit on the solver's placement, "
                               "each backward fused or split, and over the classic schedules on theirs (printed by "
                               "solve, frontier)")
    gap: float = Field(description="value / bound_under_limit - 1; status 'optimal' when it is at most 2e-6 "
                       "(float noise and the MILP's tolerances)")
    time_s: float
    time_limit_s: float
    clock: Literal["wall", "work"] = Field("wall", description="what time_s and time_limit_s count: wall-clock "
                                           "seconds, or work in nominal seconds (solve --deterministic)")
    memory_limit: str | None
    uniform_costs: bool
    milp_windows: int = 0
    milp_improvements: int = 0
    search_improvements: int = Field(0, description="times the local search over per-rank orders "
                                     "(non-FIFO included) improved the schedule")
    classic: dict[str, float] = Field(default_factory=dict, description="the objective of each classic "
                                      "schedule within the memory limit (the solver's candidates; older files lack it)")
    classic_not_built: list[str] = Field(default_factory=list, description="classic kinds not built for want of "
                                         "time (the time limit): not compared")
    fused_backwards: int = Field(0, description="backwards the schedule runs fused (one BW pass)")
    split_backwards: int = Field(0, description="backwards the schedule runs split (a B, then a W)")
    recompute: Literal["none", "auto", "full"] = Field("none", description="the recomputation the solver "
                                                       "could choose: none, per microbatch (auto) or every one (full)")
    recomputed: int = Field(0, description="recompute passes (R, RS) in the schedule: forwards run checkpointed")
    overlapped_pairs: int = Field(0, description="overlapped forward-backward pairs the schedule runs (where the "
                                  "profile has all-to-all to hide)")
    bound_covers: BoundCovers | None = Field(None, description="the schedules lower_bound and status 'optimal' cover, "
                                             "decided by recompute (filled from it where absent): no-recompute, those "
                                             "that recompute nothing (even where the profile offers recomputation); "
                                             "any-recompute, with any recomputation the profile offers or none; "
                                             "full-recompute, those that recompute every forward fully (R)")

    @model_validator(mode="after")
    def _covers(self) -> SolverInfo:
        covers = bound_covers(self.recompute)
        if self.bound_covers is None:
            self.bound_covers = covers
        elif self.bound_covers != covers:
            raise ValueError(f"bound_covers {self.bound_covers!r} does not match recompute {self.recompute!r} ({covers!r})")
        return self


class Schedule(BaseModel):
    """A pipeline schedule: per rank, the order in which it runs its passes.

    ``actions[r]`` lists rank r's actions as text (``"2F0"``: stage 2, forward, microbatch 0;
    parsed in ``rank_actions``), ``overlapped[r]`` the positions on rank r where a forward and
    the backward after it run as one overlapped pair (``zbsearch.costs``; None: no pairs;
    actions given in the compact text ``"0F3+5B1"`` are split into the two and their pair
    listed here), ``stage_to_rank`` says which rank holds each virtual stage, and
    ``profile`` holds the costs the schedule was built for. Timeline, bubble and memory follow
    from these through the simulator (``zbsearch.timeline``); ``predicted`` keeps their summary
    in the file, and ``solver`` says how a solved schedule was found and how close to optimal
    it is proven to be.

    Make one with ``zbsearch.build_classic`` or ``zbsearch.solve``, or from your own actions
    with ``Schedule.build``; check it with ``zbsearch.validate``; read and write it with
    ``load_schedule`` and ``save_schedule`` (the ``zbsearch.schedule`` v1 format).
    """

    model_config = ConfigDict(extra="forbid")

    format: Literal["zbsearch.schedule"] = "zbsearch.schedule"
    version: Literal[1] = 1
    kind: str
    num_ranks: int = Field(ge=1)
    num_stages: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    stage_to_rank: list[int]
    actions: list[list[str]]
    overlapped: list[list[int]] | None = Field(None, description=(
        "per rank, the positions i where actions[r][i] (a forward) and actions[r][i + 1] (a backward B or BW of "
        "another microbatch) run as one overlapped pair, each one's all-to-all hidden behind the other's compute; "
        "absent: no pairs"))
    memory_limit: list[float] | None = None
    # how the limit was asked for ("2p", "40GiB", "capacity"), to recompute it for another profile
    memory_limit_spec: str | None = None
    profile: Profile
    predicted: Predicted | None = None
    solver: SolverInfo | None = None
    # how a planned schedule's stages were cut from the model's units (``zbsearch plan``)
    partition: Partition | None = None

    # (id of the actions list it was parsed from, parsed lists); model_copy keeps private
    # attributes, so the id guards against a stale cache after ``update={"actions": ...}``.
    _parsed: tuple[int, list[list[Action]]] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _compact_pairs(cls, data: object) -> object:
        """Actions written as compact pairs (``"0F3+5B1"``) become the two actions and a position
        in ``overlapped``."""
        if not isinstance(data, dict) or not isinstance(data.get("actions"), list):
            return data
        rows = data["actions"]
        if not any(isinstance(t, str) and PAIR_SEP in t for row in rows if isinstance(row, list) for t in row):
            return data
        if data.get("overlapped") is not None:
            raise ValueError("pairs are given both as 'F+B' actions and in overlapped: give them one way")
        expanded, pairs = [], []
        for rank, row in enumerate(rows):
            try:
                got, at = parse_row(row)
            except (ZbError, TypeError) as err:
                raise ValueError(f"rank {rank}: {err}") from None
            expanded.append([str(a) for a in got])
            pairs.append(at)
        return {**data, "actions": expanded, "overlapped": pairs}

    @field_validator("actions")
    @classmethod
    def _syntax(cls, v: list[list[str]], info: ValidationInfo) -> list[list[str]]:
        """Each action parses and names a stage and microbatch that exist (one parse per action:
        schedules of a large m hold hundreds of thousands)."""
        S, m = info.data.get("num_stages"), info.data.get("num_microbatches")
        built = (info.context or {}).get("built")  # ``build``'s actions, which these texts spell
        for rank, row in enumerate(v):
            for pos, text in enumerate(row):
                if built is not None:
                    a = built[rank][pos]
                else:
                    try:
                        a = parse_action(text)
                    except ZbError as err:
                        raise ValueError(f"rank {rank} position {pos}: {err}") from None
                if S is not None and m is not None and (a.stage >= S or a.mb >= m):
                    raise ValueError(f"rank {rank} position {pos}: {text} is out of range ({S} stages, {m} microbatches)")
        return v

    @model_validator(mode="after")
    def _shape(self) -> Schedule:
        R, S = self.num_ranks, self.num_stages
        if len(self.stage_to_rank) != S:
            raise ValueError(f"stage_to_rank has {len(self.stage_to_rank)} entries for {S} stages")
        bad = [r for r in self.stage_to_rank if not 0 <= r < R]
        if bad:
            raise ValueError(f"stage_to_rank names rank {bad[0]} but there are only {R} ranks")
        empty = sorted(set(range(R)) - set(self.stage_to_rank))
        if empty:
            raise ValueError(f"rank {empty[0]} holds no stage")
        if len(self.actions) != R:
            raise ValueError(f"actions has {len(self.actions)} rows for {R} ranks")
        if self.memory_limit is not None and len(self.memory_limit) != R:
            raise ValueError(f"memory_limit has {len(self.memory_limit)} values for {R} ranks")
        misfit = profile_misfit(self.profile.num_stages, S, R)
        if misfit:
            raise ValueError(misfit)
        if self.partition is not None and len(self.partition.stages) != S:
            raise ValueError(f"partition has {len(self.partition.stages)} stages for the schedule's {S}")
        if self.overlapped is not None:
            problem = pairs_problem(self.actions, self.overlapped)
            if problem:
                raise ValueError(problem)
            if not any(self.overlapped):
                self.overlapped = None
        return self

    def pairs(self, rank: int) -> list[int]:
        """The positions on ``rank`` where an overlapped pair starts (its forward), in order."""
        return self.overlapped[rank] if self.overlapped is not None else []

    @property
    def num_pairs(self) -> int:
        """Overlapped pairs in the schedule."""
        return sum(map(len, self.overlapped)) if self.overlapped is not None else 0

    def compact(self) -> list[list[str]]:
        """Per rank, the actions as compact text, each overlapped pair as one ``"0F3+5B1"``."""
        return [row_text(row, self.pairs(r)) for r, row in enumerate(self.rank_actions)]

    @property
    def rank_actions(self) -> list[list[Action]]:
        """The action lists, parsed (cached; schedules are not mutated after construction)."""
        if self._parsed is None or self._parsed[0] != id(self.actions):
            self._parsed = (id(self.actions), [[parse_action(t) for t in row] for row in self.actions])
        return self._parsed[1]

    @property
    def chunks(self) -> int:
        """Stages per rank (2 for ZB-V and interleaved 1F1B, 1 otherwise)."""
        return self.num_stages // self.num_ranks

    def __repr__(self) -> str:
        parts = [f"{self.kind!r}", f"ranks={self.num_ranks}", f"stages={self.num_stages}",
                 f"microbatches={self.num_microbatches}", f"limit={self._limit_text()}"]
        if self.predicted is not None:
            parts += [f"span={max(self.predicted.span):.4g} ms", f"bubble={self.predicted.bubble_rate:.2%}"]
        if self.solver is not None:
            parts.append(f"solver={self.solver.status} (gap {self.solver.gap:.2%})")
        return f"Schedule({', '.join(parts)})"

    __str__ = __repr__

    def _limit_text(self) -> str:
        """The memory limit as asked for, else its per-rank values in the profile's unit."""
        if self.memory_limit_spec:
            return self.memory_limit_spec
        if self.memory_limit is None:
            return "none"
        lo, hi = min(self.memory_limit), max(self.memory_limit)
        unit = self.profile.memory_unit
        scale, name = (2**30, " GiB") if unit == "bytes" else (1, " activations")
        text = f"{lo / scale:.4g}" if lo == hi else f"{lo / scale:.4g}-{hi / scale:.4g}"
        return text + name

    @classmethod
    def build(
        cls,
        kind: str,
        profile: Profile,
        num_microbatches: int,
        stage_to_rank: list[int],
        actions: list[list[Action]],
        memory_limit: list[float] | None = None,
        solver: SolverInfo | None = None,
        memory_limit_spec: str | None = None,
        overlapped: list[list[int]] | None = None,
    ) -> Schedule:
        """A schedule of ``actions`` (per rank, in order) on ``profile``, checked for shape.

        Args:
            kind: a name for the order, e.g. ``"zb-h1"`` or your own.
            num_microbatches: microbatches per iteration.
            stage_to_rank: the rank that holds each virtual stage.
            actions: per rank, the actions it runs, in order.
            memory_limit: per rank, the most activation memory it may hold (the profile's unit).
            solver: how a solver found it.
            memory_limit_spec: how the limit was asked for (``"2p"``), to recompute it for
                another profile.
            overlapped: per rank, the positions of forwards that run as one overlapped pair
                with the backward after them (None: no pairs).

        Raises:
            pydantic.ValidationError: an action names a stage or microbatch that does not
                exist, or the placement does not fit the ranks or the profile.

        Nothing here checks that the order can run or stays within the limit: that is
        ``zbsearch.validate``. The result carries no ``predicted`` block until
        ``zbsearch.with_prediction`` adds it.
        """
        fields = dict(
            kind=kind,
            num_ranks=max(stage_to_rank) + 1,
            num_stages=len(stage_to_rank),
            num_microbatches=num_microbatches,
            stage_to_rank=list(stage_to_rank),
            actions=[[str(a) for a in row] for row in actions],
            memory_limit=memory_limit,
            memory_limit_spec=memory_limit_spec,
            profile=profile,
            solver=solver,
            overlapped=None if overlapped is None else [list(p) for p in overlapped],
        )
        sched = cls.model_validate(fields, context={"built": actions})  # no need to parse what we spelled
        sched._parsed = (id(sched.actions), [list(row) for row in actions])
        return sched


_PAIR_FIRST = {Op.F.value}
_PAIR_SECOND = {Op.B.value, Op.BW.value}


def pairs_problem(actions: list[list[str]], overlapped: list[list[int]]) -> str | None:
    """Why ``overlapped`` does not fit ``actions`` (one line), or None: one list per rank, its
    positions increasing, each a forward followed by a backward (B or BW), no two pairs sharing
    an action. Whether the two passes depend on each other is the validator's check."""
    if len(overlapped) != len(actions):
        return f"overlapped has {len(overlapped)} rows for {len(actions)} ranks"
    for rank, (row, pairs) in enumerate(zip(actions, overlapped)):
        last = -2
        for i in pairs:
            if not 0 <= i < len(row) - 1:
                return (f"overlapped[{rank}] names position {i}, but a pair needs positions {i} and {i + 1} "
                        f"and rank {rank} has {len(row)} actions")
            if i <= last + 1:
                what = "is listed twice" if i == last else "overlaps the pair before it" if i == last + 1 else "is out of order"
                return f"overlapped[{rank}]: position {i} {what} (positions increase, each pair two actions of its own)"
            f, b = parse_action(row[i]), parse_action(row[i + 1])
            if f.op.value not in _PAIR_FIRST or b.op.value not in _PAIR_SECOND:
                return (f"rank {rank}: the pair at position {i}, {row[i]}{PAIR_SEP}{row[i + 1]}, is not a forward followed "
                        f"by a backward (B or BW)")
            last = i
    return None


def load_schedule(path: str | os.PathLike) -> Schedule:
    """The schedule in a ``zbsearch.schedule`` file.

    Raises:
        ZbError: no such file, or not a valid schedule file (one line naming the field).
    """
    return read_model(Schedule, path)


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write ``schedule`` as JSON to ``path`` (atomically: a failed write leaves no partial file)."""
    write_model(schedule, path)
