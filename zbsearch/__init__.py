"""zbsearch: zero-bubble pipeline-parallel schedules, from profile to solver to runtime.

The core (this package minus ``runtime`` and ``profiler``) never imports torch: profile and
schedule formats, cost model, dependency graph, simulator, validator, bounds, classic
schedules and the solver are pure Python.
"""

from .actions import Action, Op, parse_action
from .bounds import makespan_lower_bound, span_lower_bound
from .classic import CLASSIC_KINDS, build_classic
from .costs import CostModel
from .errors import ZbError
from .greedy import greedy_schedule
from .limits import parse_memory_limit
from .predict import predict, timeline, with_prediction
from .profile import Profile, StageCost, load_profile, resolve_profile, save_profile
from .schedule import Predicted, Schedule, load_schedule, save_schedule
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
    "greedy_schedule",
    "parse_memory_limit",
    "CLASSIC_KINDS",
    "build_classic",
    "ZbError",
]
