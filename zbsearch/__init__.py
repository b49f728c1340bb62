"""zbsearch: zero-bubble pipeline-parallel schedules, from profile to solver to runtime.

The three steps, one import each::

    from zbsearch import load_profile, solve       # a profile file or a bundled name
    result = solve(load_profile("1.5b-m24"), 24, mem_limit="1p", time_limit=10)
    from zbsearch.runtime import PipelineRuntime   # replays result.schedule in torch.distributed

(``zbsearch.profiler.profile_model`` measures a profile of your own model.)

Data flows one way: ``formats.profile`` -> ``costs`` -> ``solver`` (or ``classic``) ->
``formats.schedule`` -> ``runtime``. The core never imports torch: the formats, cost model,
``dependencies`` (the one place that knows which pass needs which), ``layout`` (which rank
holds which stage), ``simulator``, ``prediction``, ``validator``, ``bounds``, ``classic``
schedules, ``solver``, ``compare`` (every kind side by side) and ``render``. torch lives in
``profiler``, ``runtime``, ``models``, ``distributed`` and ``app``.

The names below load on first use (PEP 562): ``import zbsearch`` stays cheap, so the command
line can catch Ctrl-C from its first instant (``zbsearch.app.main``) and tools that need one
module do not pay for pydantic and the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _lazy
from ._version import __version__

if TYPE_CHECKING:
    from .actions import Action, Op, parse_action
    from .bounds import makespan_lower_bound, span_lower_bound
    from .classic import CLASSIC_KINDS, KINDS, build_classic
    from .costs import CostModel
    from .errors import ZbError
    from .formats.profile import Profile, StageCost, load_profile, resolve_profile, save_profile
    from .formats.schedule import Predicted, Schedule, SolverInfo, load_schedule, save_schedule
    from .layout import placement
    from .limits import fits, parse_memory_limit
    from .prediction import predict, timeline, with_prediction
    from .simulator import Timeline, simulate
    from .solver.frontier import frontier  # (from the defining modules: each shadows its module's name)
    from .solver.solve import SolveResult, solve
    from .validator import InvalidSchedule, find_problem, validate

# each public name's module (the imports above, for type checkers, say the same)
_MODULES = {
    ".actions": ("Action", "Op", "parse_action"),
    ".bounds": ("makespan_lower_bound", "span_lower_bound"),
    ".classic": ("CLASSIC_KINDS", "KINDS", "build_classic"),
    ".costs": ("CostModel",),
    ".errors": ("ZbError",),
    ".formats.profile": ("Profile", "StageCost", "load_profile", "resolve_profile", "save_profile"),
    ".formats.schedule": ("Predicted", "Schedule", "SolverInfo", "load_schedule", "save_schedule"),
    ".layout": ("placement",),
    ".limits": ("fits", "parse_memory_limit"),
    ".prediction": ("predict", "timeline", "with_prediction"),
    ".simulator": ("Timeline", "simulate"),
    ".solver.frontier": ("frontier",),
    ".solver.solve": ("SolveResult", "solve"),
    ".validator": ("InvalidSchedule", "find_problem", "validate"),
}
_SOURCES = {name: module for module, names in _MODULES.items() for name in names}
__all__ = ["__version__", *_SOURCES]


def __getattr__(name: str) -> Any:
    return _lazy.load(__name__, _SOURCES, name)


def __dir__() -> list[str]:
    return sorted(__all__)
