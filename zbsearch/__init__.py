"""zbsearch: zero-bubble pipeline-parallel schedules, from profile to solver to runtime.

Data flows one way: ``formats.profile`` -> ``costs`` -> ``solver`` (or ``classic``) ->
``formats.schedule`` -> ``runtime``. The core never imports torch: the formats, cost model,
``dependencies`` (the one place that knows which pass needs which), ``placement``,
``simulator``, ``validator``, ``bounds``, ``classic`` schedules, ``solver`` and ``render``.
torch lives in ``profiler``, ``runtime``, ``models``, ``distributed`` and ``app``.
"""

from .actions import Action, Op, parse_action
from .bounds import makespan_lower_bound, span_lower_bound
from .classic import CLASSIC_KINDS, KINDS, build_classic
from .costs import CostModel
from .errors import ZbError
from .formats.profile import Profile, StageCost, load_profile, resolve_profile, save_profile
from .formats.schedule import Predicted, Schedule, SolverInfo, load_schedule, save_schedule
from .limits import fits, parse_memory_limit
from .placement import placement
from .predict import predict, timeline, with_prediction
from .simulator import Timeline, simulate
from .validator import InvalidSchedule, find_problem, validate

__all__ = [
    "Action",
    "Op",
    "parse_action",
    "Profile",
    "StageCost",
    "load_profile",
    "resolve_profile",
    "save_profile",
    "Schedule",
    "Predicted",
    "SolverInfo",
    "load_schedule",
    "save_schedule",
    "CostModel",
    "Timeline",
    "simulate",
    "timeline",
    "predict",
    "with_prediction",
    "validate",
    "find_problem",
    "InvalidSchedule",
    "span_lower_bound",
    "makespan_lower_bound",
    "parse_memory_limit",
    "fits",
    "CLASSIC_KINDS",
    "KINDS",
    "placement",
    "build_classic",
    "ZbError",
]
