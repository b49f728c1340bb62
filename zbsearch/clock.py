"""The clock every phase of solve, plan and tune reads: wall seconds, or counted work.

A builder given a ``deadline`` (an instant of ``now``) always completes one schedule; once the
deadline has passed it stops improving and returns the best complete schedule it has (ZB-V:
the best of its constructions so far; V-Half and V-Min: the building blocks squeezed as far as
they got). The solver's budget, its phases, plan's and tune's clocks read ``now`` too, and
nothing else, so that a test can replace it and so that one switch changes what time means
for all of them.

Two clocks:

* **wall** (the default): ``now`` is ``time.monotonic()``. A limit holds in real seconds, and
  what a search finds by then depends on the machine and its load.
* **work** (``work_clock()``, ``--deterministic``): ``now`` counts work done, in nominal
  seconds: simulated passes, reads of the clock itself (each a loop's step between two looks),
  and HiGHS's work on the MILP models: its looks at whether to stop (its MIP interrupt
  callback, at fixed points of its search) and its simplex iterations, each times the model's
  nonzeros; a MILP is stopped at its share by the looks, not by seconds (``highs_limits``).
  ``WORK_RATES`` converts them, set so that a nominal second is about a CPU second of the
  2-core machine the benchmarks run on (within a factor of about 2). The same
  inputs and limit then give the same result on any machine and at any load; the limit no
  longer holds in real seconds (a loaded machine takes longer).

The work clock is per process: a worker process enters it for each task it is given (``tune``
passes the mode with its tasks), starting from zero, so that a task's result depends on its
inputs only, not on what the worker did before.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

__all__ = ["now", "passed", "work_clock", "counting", "with_work_clock", "kind", "simulated", "spend", "highs_limits",
           "highs_spent", "WorkRates", "WORK_RATES"]


@dataclass(frozen=True)
class WorkRates:
    """How much counted work makes one nominal second of the work clock.

    Attributes:
        passes: simulated passes (one action of one rank timed by the simulator).
        reads: reads of the clock (each stands for the step of a loop between two looks).
        looks: HiGHS's looks at whether to stop a MIP (its interrupt callback) times the
            model's nonzeros.
        iterations: HiGHS's simplex iterations of an LP times the model's nonzeros.
        models: HiGHS runs (building a model, presolve, start-up), whatever their size: on the
            small programs the bounds solve by the thousand this, not their iterations, is the
            work.
    """

    passes: float = 1.0e6
    reads: float = 2.0e4
    looks: float = 1.8e4
    iterations: float = 1.0e7
    models: float = 200.0


WORK_RATES = WorkRates()


class _Work:
    """The process's work clock: whether it is on, and the nominal seconds counted."""

    on: bool = False
    seconds: float = 0.0


def now() -> float:
    """The clock every builder, the solver's budget and plan's and tune's clocks read: monotonic
    seconds, or under ``work_clock`` the work counted so far (nominal seconds; each read counts)."""
    if _Work.on:
        _Work.seconds += 1.0 / WORK_RATES.reads
        return _Work.seconds
    return time.monotonic()


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (None: none) has passed."""
    return deadline is not None and now() > deadline


def counting() -> bool:
    """Whether the work clock is on in this process."""
    return _Work.on


@contextlib.contextmanager
def work_clock(on: bool = True) -> Iterator[None]:
    """Inside the block, ``now`` counts work from zero (where ``on``; a block inside another
    keeps counting where the outer one is). The wall clock again after it."""
    if not on or _Work.on:
        yield
        return
    _Work.on, _Work.seconds = True, 0.0
    try:
        yield
    finally:
        _Work.on, _Work.seconds = False, 0.0


_F = TypeVar("_F", bound=Callable[..., Any])


def with_work_clock(fn: _F) -> _F:
    """``fn`` (whose keyword ``deterministic`` asks for it) runs on the work clock where
    ``deterministic`` is true: ``solve``, ``plan`` and ``tune`` take the option so."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with work_clock(bool(kwargs.get("deterministic", False))):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def kind() -> Literal["wall", "work"]:
    """The clock in use, as results record it (their ``time_s`` is in its seconds)."""
    return "work" if _Work.on else "wall"


def spend(seconds: float) -> None:
    """Count ``seconds`` of work (nominal) done elsewhere, e.g. by a worker process; nothing
    on the wall clock."""
    if _Work.on:
        _Work.seconds += max(0.0, seconds)


def simulated(passes: int) -> None:
    """Count a simulation of ``passes`` passes."""
    if _Work.on:
        _Work.seconds += passes / WORK_RATES.passes


def highs_limits(seconds: float, nonzeros: int) -> tuple[float, int | None]:
    """A HiGHS model's (time limit in seconds, most looks at whether to stop) for ``seconds``
    on the clock: on the wall clock the seconds and no limit on looks; on the work clock no time
    limit and the looks that many nominal seconds buy on a model of ``nonzeros``."""
    s = max(0.1, seconds)
    if not _Work.on:
        return s, None
    return math.inf, max(1, int(s * WORK_RATES.looks / max(1, nonzeros)))


def highs_spent(looks: int, iterations: int, nonzeros: int) -> None:
    """Count what a HiGHS run did: the run itself, its looks at whether to stop (a MIP's
    interrupt callback, or its branch-and-bound nodes where nothing looked) and its simplex
    iterations (``info.simplex_iteration_count``) on a model of ``nonzeros``."""
    if _Work.on:
        n = max(1, nonzeros)
        _Work.seconds += (1.0 / WORK_RATES.models + max(0, looks) * n / WORK_RATES.looks
                          + max(0, iterations) * n / WORK_RATES.iterations)
