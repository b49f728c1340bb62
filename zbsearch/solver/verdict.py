"""What a solve's result means, in words: its status and what decides it, which schedules its
bound covers, how it compares with the classic schedules, whether its backwards run fused or
split and why, and what recomputation the profile offers that the solve did not search.

The status is decided by one rule, stated with the numbers it reads: ``optimal`` when the gap
(value / bound - 1) is at most ``CLOSED``, otherwise ``time_limit`` when some part of the
solve (the construction, the bound, a search) stopped at its share of the time limit before it
was done, else ``feasible``. The gap is printed with as many digits as it takes for the
printed number to fall on the same side of the threshold as the true one. The bound, and so
``optimal``, covers the schedules ``SolverInfo.bound_covers`` names: those with the
recomputation the solve could choose, never more.
"""

from __future__ import annotations

from decimal import Decimal

from ..actions import Op
from ..costs import CostModel
from ..formats.schedule import Schedule, SolverInfo, bound_covers

__all__ = ["CLOSED", "decide_status", "gap_text", "status_text", "bound_name", "covered", "unsearched", "explain"]

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


# The schedules a bound covers (``SolverInfo.bound_covers``), as the lines below name them.
_COVERED = {"no-recompute": "without recomputation", "any-recompute": "with or without recomputation",
            "full-recompute": "recomputing every forward (R)"}


def covered(recompute: str) -> str:
    """The schedules a solve recomputing as ``recompute`` allows bounds, in words: "without
    recomputation", "with or without recomputation", "recomputing every forward (R)"."""
    return _COVERED[bound_covers(recompute)]


def bound_name(info: SolverInfo) -> str:
    """The bound's name as printed, with the schedules it covers: ``bound (under limit, without recomputation)``."""
    return f"bound (under limit, {covered(info.recompute)})"


def status_text(info: SolverInfo) -> str:
    """The status and what decided it, e.g. ``gap 0.000100% > 0.0001%: feasible``; ``optimal``
    names the schedules it covers."""
    limit = _LIMIT + "%"
    gap = gap_text(info.gap)
    if info.status == "optimal":
        return f"gap {gap} <= {limit}: status optimal (no schedule {covered(info.recompute)} within the limit is shorter)"
    why = ("a part of the solve stopped at its share of the time limit" if info.status == "time_limit"
           else "every part of the solve ran to its end")
    return f"gap {gap} > {limit}: status {info.status} ({why})"


def unsearched(cost: CostModel, recompute: str) -> str | None:
    """Where the profile (``cost``) offers recomputation that a solve recomputing as
    ``recompute`` allows did not search: what its bound leaves out and what ``--recompute auto``
    would do; None where it searched all the profile offers."""
    if recompute == "auto" or not cost.can_recompute:
        return None
    selective = any(cost.offer(s, Op.RS) is not None for s in range(cost.num_stages))
    auto = "--recompute auto would choose per stage and microbatch"
    if recompute == "none":
        kinds = " and ".join(k for k, offered in (("full (R)", any(cost.offer(s, Op.R) is not None
                                                                    for s in range(cost.num_stages))),
                                                   ("selective (RS)", selective)) if offered)
        return (f"recomputation not searched (--recompute none): the profile offers {kinds} recomputation, and the "
                f"bound covers only schedules without it; {auto} which forwards to checkpoint and recompute under "
                "the limit, and may find a shorter schedule")
    rs = ", or recompute selectively (RS), which the profile offers" if selective else ""
    return (f"only schedules that recompute every forward (R) searched (--recompute full), and the bound covers only "
            f"those; {auto} which forwards not to recompute{rs}, and may find a shorter schedule")


def _ratios(cost: CostModel) -> str:
    """How many times a fused BW the split B + W cost, over the stages: '2.4x' or '1.9-2.8x'."""
    r = [(b + w) / bw for b, w, bw in zip(cost.t_b, cost.t_w, cost.t_bw)]
    lo, hi = min(r), max(r)
    return f"{lo:.2g}x" if f"{lo:.2g}" == f"{hi:.2g}" else f"{lo:.2g}-{hi:.2g}x"


def explain(schedule: Schedule, info: SolverInfo) -> list[str]:
    """Lines that say how the solved schedule compares with the classic ones within the limit,
    how its backwards run: fused (one BW), split (B then W) or mixed, and what it costs, and
    what recomputation the profile offers that the solve did not search (``unsearched``)."""
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
    note = unsearched(cost, info.recompute)
    if note is not None:
        out.append(note)
    return out
