"""Does the profile predict the runtime? Per-pass times of runtime traces against a profile.

The runtime's trace times each action's compute alone (``runtime.trace``), so its F, B and W
durations are directly comparable with the profile's T_F, T_B and T_W of the same stage. Used
by the profiler's accuracy test and ``bench/profiler.py``, on traces of split schedules (ZB-V,
ZB-H1): in a schedule that fuses a backward, that microbatch's F is the profile's T_FF, not T_F
(``CostModel.durations``; ``zbsearch simulate --measured`` compares such schedules).

A pass with (almost) nothing to do, such as a first stage's B (its whole backward is W's), is
not compared (``tolerances.negligible``): a relative error says nothing (a few microseconds of
call overhead either way) and such a pass cannot move a schedule.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..actions import Op
from ..formats.profile import Profile
from ..formats.trace import Trace
from ..tolerances import negligible

__all__ = ["PassAgreement", "runtime_vs_profile"]


@dataclass(frozen=True)
class PassAgreement:
    """One pass type of one stage: its profiled time against the runtime's median."""

    stage: int
    op: Op
    profiled: float  # ms
    measured: float  # ms, median over every occurrence in the traces

    @property
    def error(self) -> float:
        """Measured over profiled, less 1 (0.05: the runtime took 5% longer)."""
        return self.measured / self.profiled - 1


def runtime_vs_profile(profile: Profile, traces: list[Trace]) -> list[PassAgreement]:
    """F, B and W of every profile stage but negligible passes; trace stage s is profile stage s."""
    durations: dict[tuple[int, Op], list[float]] = defaultdict(list)
    for trace in traces:
        for ev in trace.traceEvents:
            durations[(ev.args.stage, ev.args.op)].append(ev.dur / 1e3)
    rows = []
    for s, st in enumerate(profile.stages):
        for op, profiled in ((Op.F, st.t_f), (Op.B, st.t_b), (Op.W, st.t_w)):
            if durations[(s, op)] and not negligible(profiled, st.t_f + st.t_b + st.t_w):
                rows.append(PassAgreement(s, op, profiled, statistics.median(durations[(s, op)])))
    return rows
