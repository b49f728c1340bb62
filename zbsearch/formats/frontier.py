"""Frontier file format (``zbsearch.frontier`` v1): bubble rate against memory limit."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .fileio import read_model, write_model

__all__ = ["FrontierPoint", "Frontier", "load_frontier", "save_frontier"]


class FrontierPoint(BaseModel):
    """The solved schedule at one memory limit: its bubble rate, the bound and the gap."""

    model_config = ConfigDict(extra="forbid")

    limit: float = Field(description="memory limit as x in x * p * M_B per rank")
    bubble_rate: float = Field(description="bubble rate of the objective (span or makespan)")
    bound_bubble_rate: float = Field(description="the least bubble rate the lower bound allows")
    span: float
    makespan: float
    peak_memory: list[float]
    lower_bound: float
    gap: float
    status: str
    recomputed: int = Field(0, description="recompute passes in the point's schedule")


class Frontier(BaseModel):
    """Bubble rate against memory limit for one profile and microbatch count (``zbsearch frontier``)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["zbsearch.frontier"] = "zbsearch.frontier"
    version: Literal[1] = 1
    profile: str
    num_microbatches: int
    chunks: int
    objective: Literal["span", "makespan"]
    uniform_costs: bool
    recompute: Literal["none", "auto", "full"] = "none"
    unlimited_bubble_rate: float
    points: list[FrontierPoint]


def load_frontier(path: str | os.PathLike) -> Frontier:
    """The frontier in a ``zbsearch.frontier`` file; every problem is one ZbError line."""
    return read_model(Frontier, path)


def save_frontier(fr: Frontier, path: str | os.PathLike) -> None:
    """Write ``fr`` as JSON to ``path``, atomically."""
    write_model(fr, path)
