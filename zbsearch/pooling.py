"""Several profiles of one model, measured at different times, pooled into one.

A pass timed for one second says what the machine did in that second. On a shared machine
(a VM with neighbours, a node whose clocks move) a stage's median over a few repetitions can
move far beyond its spread within a minute, while a training run lasts far longer. So the profiler
measures in rounds, each round
every stage and link once, and pools them here; a benchmark can interleave rounds of profiling
with rounds of training steps so that the machine's drift falls on both alike.

Pooling takes, per number, the median over the rounds (the mean for link times, which are
costed at their mean), and records each round's pass times and the drift: per stage and pass,
the range of the round medians over their median. A drift above ``DRIFT_LIMIT`` is a warning
(one line for all passes; a negligible pass, ``tolerances.negligible``, is none) in the pooled
profile: the machine changed speed while being measured, and a prediction from this profile
holds only as well as the machine stays as it was on average.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .errors import ZbError
from .formats.edit import updated
from .formats.layers import LayerProfile
from .formats.profile import MIN_TIME_MS, Links, Profile, Quartiles, StageCost, StageSpread, WayNotTaken, pass_time_fields
from .tolerances import negligible

__all__ = ["DRIFT_LIMIT", "PASSES", "pool_profiles", "pool_layers", "drift"]

DRIFT_LIMIT = 0.10
PASSES = pass_time_fields()
# absent from older profiles: pooled only where every round has them
_OPTIONAL = tuple(k for k in PASSES if not StageCost.model_fields[k].is_required())
# a first stage's passes, timed both ways its W can run
_SPLIT = tuple(k for k in PASSES if k in WayNotTaken.model_fields)


def drift(profiles: Sequence[Profile]) -> list[dict[str, float]]:
    """Per stage and pass time: (max - min) / median over the profiles' values (0 for one)."""
    out = []
    for s in range(profiles[0].num_stages):
        row = {}
        for k in PASSES:
            xs = [getattr(p.stages[s], k) for p in profiles]
            if all(x is not None for x in xs):
                row[k] = (max(xs) - min(xs)) / statistics.median(xs)
        out.append(row)
    return out


def pool_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile from rounds of the same measurement (same model, stages, placement, units);
    the first round's description (device, settings, links' method) is kept."""
    if not profiles:
        raise ZbError("no profile to pool")
    first = profiles[0]
    for i, p in enumerate(profiles[1:], 2):
        same = (p.num_stages, p.placement, p.memory_unit, p.microbatch_size, p.selective)
        if same != (first.num_stages, first.placement, first.memory_unit, first.microbatch_size, first.selective):
            raise ZbError(f"profile {i} ({p.name}) is not of the same stages as profile 1 ({first.name}): cannot pool")
    if len(profiles) == 1:
        return first
    stages = [_pool_stage([p.stages[s] for p in profiles]) for s in range(first.num_stages)]
    update: dict = {"stages": stages}
    ways = _pool_first_stage_ways(profiles)
    if ways is not None:
        stages[0] = updated(stages[0], **ways[0])
    for name, how in (("t_comm", statistics.fmean), ("t_send", statistics.median), ("t_recv", statistics.median)):
        if getattr(first, name) is not None:
            update[name] = [how([p.comm(b, name) for p in profiles]) for b in range(first.num_stages - 1)]
    actions = [p.t_action for p in profiles if p.t_action is not None]
    if actions:  # the runtime's host time per action: the rounds' median, as the messages'
        update["t_action"] = statistics.median(actions)
    if first.measured is not None and all(p.measured is not None for p in profiles):
        update["measured"] = _pool_measured(profiles)
        if ways is not None:
            spreads = list(update["measured"].stages)
            spreads[0] = updated(spreads[0], **ways[1])
            update["measured"] = updated(update["measured"], stages=spreads)
    if first.links is not None and all(p.links is not None for p in profiles):
        update["links"] = _pool_links(profiles)
    return updated(first, **update)


def pool_layers(profiles: Sequence[LayerProfile]) -> LayerProfile:
    """One per-layer profile from several of the same units (rounds measured at different
    times, or by several ranks at once): each unit's pass times and memory deltas at their
    median, W's memory balancing them; everything else (sizes, links, warnings) is the first's."""
    if not profiles:
        raise ZbError("no per-layer profile to pool")
    first = profiles[0]
    for i, p in enumerate(profiles[1:], 2):
        if (p.names, p.microbatch_size, p.selective) != (first.names, first.microbatch_size, first.selective):
            raise ZbError(f"per-layer profile {i} ({p.name}) is not of the same units as profile 1 ({first.name}): "
                          f"cannot pool")
    if len(profiles) == 1:
        return first
    units = []
    for i, unit in enumerate(first.units):
        med = {}
        for k in (*PASSES, "m_f", "m_b"):
            xs = [getattr(p.units[i], k) for p in profiles]
            med[k] = statistics.median(xs) if all(x is not None for x in xs) else None
        m_f, m_b = med["m_f"], med["m_b"]
        assert m_f is not None and m_b is not None  # required fields
        units.append(updated(unit, **med, m_w=-(m_f + m_b)))
    return updated(first, units=units)


def _pool_links(profiles: Sequence[Profile]) -> Links:
    """The links' recorded quartiles per boundary pooled as the times are: the pooled t_comm
    is then the pooled record's mean, t_send / t_recv its medians."""
    docs = [p.links.model_dump() for p in profiles if p.links is not None]
    pooled = dict(docs[0])
    for key in ("one_way_ms", "send_ms", "recv_ms"):
        rows: list[list] = [d[key] for d in docs if isinstance(d.get(key), list)]
        if len(rows) == len(docs) and all(len(r) == len(rows[0]) for r in rows):
            pooled[key] = [
                None if any(r[b] is None for r in rows) else _median_quartiles([Quartiles(**r[b]) for r in rows])
                for b in range(len(rows[0]))
            ]
    return Links.model_validate(pooled)


def _pool_stage(costs: list[StageCost]) -> StageCost:
    """Each pass time's median over the rounds (an optional one only where every round has it),
    and the memory deltas' medians, W's taken as what balances them as the format demands."""
    med: dict[str, float | None] = {}
    for k in (*PASSES, "m_f", "m_b", "m_fc", "m_fs"):
        xs = [getattr(c, k) for c in costs]
        med[k] = statistics.median(xs) if all(x is not None for x in xs) else None
    m_f, m_b = med["m_f"], med["m_b"]
    assert m_f is not None and m_b is not None  # required fields
    return updated(costs[0], **med, m_w=-(m_f + m_b))


def _pool_first_stage_ways(profiles: Sequence[Profile]) -> tuple[dict, dict] | None:
    """A first stage timed both ways its W can run (``StageCost.deferred_first``) in every
    round: each way's times pooled over the rounds (a round's own way from its stage, the other
    from its record), and the way whose pooled F + B + W costs less kept, as one round would
    (rounds may have picked differently where the ways are close). Returns the stage's and its
    record's updates; None where a round lacks the other way."""
    # per way, per round: each pass's record and its cost (a round's own way: the stage's times;
    # the other way: its record's means, which is what the profiler costs a pass at). Where a
    # round took its own way's times inside steps (``profiler.in_step``), the steps ran that way
    # only: the other way's means are scaled pass by pass as the steps scaled its own, so that
    # both ways are compared, and costed, on the same footing.
    per_way: dict[bool, list[dict[str, tuple[Quartiles, float | None]]]] = {False: [], True: []}
    for p in profiles:
        spread = p.measured.stages[0] if p.measured is not None and p.measured.stages else None
        if spread is None or spread.not_taken is None:
            return None
        own, other = p.stages[0].deferred_first, spread.not_taken
        per_way[own].append({k: (getattr(spread, k), getattr(p.stages[0], k)) for k in _SPLIT})
        steps = spread.in_step or {}
        per_way[not own].append({k: (getattr(other, k), _as_in_steps(getattr(other, k).mean, getattr(p.stages[0], k),
                                                                      getattr(spread, k).mean) if k in steps
                                     else getattr(other, k).mean) for k in _SPLIT})
    pooled: dict[bool, dict[str, Quartiles | None]] = {False: {}, True: {}}
    times: dict[bool, dict[str, float]] = {False: {}, True: {}}
    for d, rows in per_way.items():
        for k in _SPLIT:
            costs = [r[k][1] for r in rows]
            if any(c is None for c in costs):  # recorded before means were
                return None
            pooled[d][k] = _median_quartiles([r[k][0] for r in rows])
            times[d][k] = max(statistics.median(c for c in costs if c is not None), MIN_TIME_MS)
    d = min((False, True), key=lambda d: sum(times[d].values()))
    not_taken = WayNotTaken.model_validate({"w": "plain" if d else "deferred", **pooled[not d]})
    return {"deferred_first": d, **times[d]}, {**pooled[d], "not_taken": not_taken}


def _as_in_steps(mean: float | None, own_cost: float, own_mean: float | None) -> float | None:
    """The other way's mean scaled by own_cost / own_mean, as the steps scaled the own way's
    repetitions' mean to its cost; None where a mean was not recorded."""
    if mean is None or own_mean is None:
        return None
    return mean * own_cost / max(own_mean, MIN_TIME_MS)


def _pool_measured(profiles: Sequence[Profile]):
    first = profiles[0].measured
    assert first is not None
    spreads = []
    for s in range(len(first.stages)):
        rows = [p.measured.stages[s] for p in profiles if p.measured is not None and s < len(p.measured.stages)]
        if len(rows) != len(profiles):
            return first  # a round without its spreads: keep the first as it is
        fields: dict = {k: _median_quartiles([getattr(r, k) for r in rows]) for k in PASSES if k in StageSpread.model_fields}
        if all(r.in_step for r in rows):  # the passes timed in steps, where every round has them
            keys = [k for k in rows[0].in_step or {} if all(k in (r.in_step or {}) for r in rows)]
            fields["in_step"] = {k: _median_quartiles([(r.in_step or {})[k] for r in rows]) for k in keys}
        spreads.append(updated(rows[0], **fields))
    drifts = drift(profiles)
    warnings = list(dict.fromkeys(w for p in profiles if p.measured is not None for w in p.measured.warnings))
    drifted = sorted(((d, s, k) for s, row in enumerate(drifts) for k, d in row.items()
                      if d > DRIFT_LIMIT and not _negligible(profiles, s, k)), reverse=True)
    if drifted:  # one line, however many passes: the cause is the machine, not a pass
        d, s, k = drifted[0]
        warnings.append(
            f"the machine changed speed while being measured: {len(drifted)} pass time(s) ranged over more than "
            f"{DRIFT_LIMIT:.0%} of their median between the {len(profiles)} rounds, up to {d:.0%} (stage {s} "
            f"{k[2:].upper()}); the profile takes the rounds' medians"
        )
    rounds = {"count": len(profiles), "drift": drifts,
              "stages": [[{k: getattr(c, k) for k in PASSES if getattr(c, k) is not None} for c in p.stages] for p in profiles]}
    return updated(first, stages=spreads, warnings=warnings, rounds=rounds)


def _negligible(profiles: Sequence[Profile], s: int, k: str) -> bool:
    """Whether stage ``s``'s pass time ``k`` is negligible (``tolerances.negligible``), by the
    rounds' medians."""
    stages = [p.stages[s] for p in profiles]
    return negligible(statistics.median(getattr(st, k) for st in stages),
                      statistics.median(st.t_f + st.t_b + st.t_w for st in stages))


def _median_quartiles(qs: list[Quartiles | None]) -> Quartiles | None:
    if any(q is None for q in qs):
        return None
    got = [q for q in qs if q is not None]
    means = [q.mean for q in got]
    return Quartiles(
        median=statistics.median(q.median for q in got), q1=statistics.median(q.q1 for q in got),
        q3=statistics.median(q.q3 for q in got),
        mean=statistics.fmean(m for m in means if m is not None) if all(m is not None for m in means) else None,
    )
