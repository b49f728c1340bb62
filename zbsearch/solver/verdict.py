"""What a solve's result means, in words: its status and what decides it, how it compares with
the classic schedules, and whether its backwards run fused or split and why.

The status is decided by one rule, stated with the numbers it reads: ``optimal`` when the gap
(value / bound - 1) is at most ``CLOSED``, otherwise ``time_limit`` when a search was cut by
the time limit, else ``feasible``. The gap is printed with as many digits as it takes for the
printed number to fall on the same side of the threshold as the true one.
"""

from __future__ import annotations

from decimal import Decimal

from ..costs import CostModel
from ..formats.schedule import Schedule, SolverInfo

__all__ = ["CLOSED", "decide_status", "gap_text", "status_text", "explain"]

# Gap at or below which a schedule counts as optimal: float noise in sums of pass times (1e-6)
# plus the margin the exact MILP takes off HiGHS's dual bound for its tolerances (1e-6,
# ``milp._DUAL_MARGIN``), so that an optimum the MILP proves is called one.
CLOSED = 2e-6
_LIMIT = f"{CLOSED * 100:g}"  # the same, in percent as printed


def decide_status(gap: float, hit_limit: bool) -> str:
    """The status of a schedule with this gap (the module's rule)."""
    return "optimal" if gap <= CLOSED else ("time_limit" if hit_limit else "feasible")


def gap_text(gap: float) -> str:
    """The gap as a percentage, with enough digits to show on which side of ``CLOSED`` it is."""
    threshold = Decimal(_LIMIT)
    for digits in range(2, 16):
        text = f"{gap * 100:.{digits}f}"
        if (Decimal(text) <= threshold) == (gap <= CLOSED):
            return text + "%"
    return f"{gap!r} (a fraction)"


def status_text(info: SolverInfo) -> str:
    """The status and what decided it, e.g. ``gap 0.000100% > 0.0001%: feasible``."""
    limit = _LIMIT + "%"
    gap = gap_text(info.gap)
    if info.status == "optimal":
        return f"gap {gap} <= {limit}: status optimal (nothing within the limit is shorter)"
    why = "a search was cut by the time limit" if info.status == "time_limit" else "the searches ran to their end"
    return f"gap {gap} > {limit}: status {info.status} ({why})"


def _ratios(cost: CostModel) -> str:
    """How many times a fused BW the split B + W cost, over the stages: '2.4x' or '1.9-2.8x'."""
    r = [(b + w) / bw for b, w, bw in zip(cost.t_b, cost.t_w, cost.t_bw)]
    lo, hi = min(r), max(r)
    return f"{lo:.2g}x" if f"{lo:.2g}" == f"{hi:.2g}" else f"{lo:.2g}-{hi:.2g}x"


def explain(schedule: Schedule, info: SolverInfo) -> list[str]:
    """Lines that say how the solved schedule compares with the classic ones within the limit,
    and how its backwards run: fused (one BW), split (B then W) or mixed, and what it costs."""
    out = []
    what = info.objective
    if info.classic:
        kind = min(info.classic, key=lambda k: info.classic[k])
        best = info.classic[kind]
        if schedule.kind in info.classic:
            out.append(f"the best schedule found is the classic {schedule.kind}: no other schedule found is shorter")
        elif info.value < best:
            out.append(f"{1 - info.value / best:.2%} shorter than the best classic schedule within the limit, "
                       f"{kind} ({what} {best:.6g} ms)")
        else:
            out.append(f"as long as the best classic schedule within the limit, {kind} ({what} {best:.6g} ms)")
    elif not info.classic_not_built:
        out.append("no classic schedule fits the memory limit")
    if info.classic_not_built:
        out.append(f"not compared (no time left to build them): {', '.join(info.classic_not_built)}; "
                   "a longer --time-limit builds them")
    cost = CostModel.from_profile(schedule.profile, schedule.stage_to_rank)
    fused, split = info.fused_backwards, info.split_backwards
    ratio = _ratios(cost)
    if fused and not split:
        out.append(f"every backward runs fused (BW): a zero-bubble split (B, then W later) did not pay on this "
                   f"profile, where B + W costs {ratio} a fused BW")
    elif fused:
        out.append(f"{fused} of {fused + split} backwards run fused (BW), {split} split (B, then W) where a W fills a "
                   f"bubble; B + W costs {ratio} a fused BW")
    elif cost.fusing_may_pay():
        out.append(f"every backward runs split (B, then W): the W passes filling bubbles gain more than fusing "
                   f"would save (B + W costs {ratio} a fused BW)")
    return out
