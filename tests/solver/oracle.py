"""Exact reference optimum for small schedule problems, independent of zbsearch's solver.

Why: ``zbsearch solve`` prints a lower bound and the word ``optimal``; neither can be trusted
unless something that shares none of its reasoning finds the true optimum (issue 10). This
module reads a problem through the public cost model (``CostModel``: per-stage times,
memory deltas, comm delays) and checks every schedule it returns with the core simulator and
validator; it uses nothing from ``zbsearch.solver``, ``zbsearch.bounds`` or the heuristics.

What "a schedule" and "its value" are: per-rank lists of basic passes F, B, W. The simulator
is the definition of the timeline: each rank runs its list in order, every pass as early as
possible (ASAP) after the previous pass of its rank and after its dependencies (plus the comm
delay when the dependency ran on another rank); memory after each pass, a function of the
order alone, must stay within the limit (the validator's tolerance). ``span`` = max over ranks
of (last end - first start on that rank); ``makespan`` = last end - first start anywhere.
The optimum is over all per-rank orders: non-FIFO microbatch orders and any first pass.
With ``fused=True`` it is also over every way to run each microbatch's backward on each
stage: one fused BW action (t_bw, and the F of that microbatch on that stage then costs t_ff,
as ``CostModel.durations`` prices it) or a B then a W anywhere later on the rank; split,
fused and mixed schedules alike.

Two exact methods:

* ``cp_optimum``: OR-Tools CP-SAT. Per rank, a circuit over its passes picks the order; each
  pass's start is *equal* (not just >=) to the max of the previous pass's end on its rank and
  its dependencies' ends + comm: exactly the simulator's recurrence, so every solution is the
  ASAP timeline of its order and the CP optimum is the optimum over orders (the recurrence has
  a unique solution per deadlock-free order; deadlocked orders have none). Memory is a
  reservoir per rank with one event at each pass's start (starts on a rank are distinct
  because every pass takes positive time), so the level at each event is the memory after
  that pass.

  Why equality and not the usual scheduling model with free idle: with free idle a rank may
  start late, and its span (last end - first start) can shrink when its first forward is
  delayed into a gap. The simulator, and the runtime, never delay a pass, so such a timed
  schedule is not what its orders produce. The idle model's optimum is therefore only a lower
  bound on the ASAP optimum (offered as ``semantics="idle"``). Over all orders the two
  coincided on every instance where both were proven (a non-FIFO order lets a rank start with
  a later microbatch, which has the effect of a delay), but that is an observation, not a
  theorem, so the oracle models ASAP exactly. For ``makespan`` they provably coincide: the
  ASAP timeline of a timed schedule's orders is pointwise no later and still starts at 0, so
  the idle model (smaller, faster) is used.

  With ``fused``, each (stage, microbatch) has a literal "fused": its backward node is then a
  BW (duration t_bw, memory m_b + m_w at once: two reservoir events at the same start), its W
  node is absent (skipped by the circuit, an absent optional interval, no memory event) and its
  F lasts t_ff instead of t_f.

  With ``recompute``, each (stage, microbatch) also has a literal per recompute pass the costs
  offer there (R full, RS selective; at most one true): its recompute node is then present
  (an optional interval of t_r, skipped by the circuit otherwise, sitting at its F's end with no
  length), starts after its F ends and ends before its backward starts; its F lasts the
  checkpointed time (which takes precedence over t_ff, as ``CostModel.durations`` prices it)
  and allocates only ``keep`` at its start, the recompute node the rest at its own.

  ``fifo=True`` restricts each stage's F, B and W passes to microbatch order, which is what
  zbsearch's MILP assumes; with ASAP semantics the FIFO optimum can be strictly worse than
  the optimum for ``span`` (``issue_counterexample``: 13.56 vs 12.56).

* ``brute_force``: enumerate every per-rank order consistent with the rank's own
  dependencies, keep those within the memory limit, and simulate every combination with
  ``zbsearch.simulator.simulate`` (deadlocks skipped); with ``fused``, for every subset of
  fused (stage, microbatch) backwards; with ``recompute``, for every choice of recomputation
  per (stage, microbatch), the recompute pass anywhere between its F and its backward. Only
  for tiny problems; it cross-checks the CP model
  including its ASAP semantics and its pricing of fused passes.

Exactness: CP-SAT works on integers. Times (pass times and comm delays of the cost model) and
memory deltas are each multiplied by the least common denominator of their values written as
fractions (``Fraction.limit_denominator``), refused unless every value is that fraction to
within 1e-12 relative. Generate instances on a grid (``random_instance`` uses multiples of
1/16 for times and comm and of 1/64 for memory: dyadic, so the simulator's float sums are exact
too) and the oracle is exact for them. A memory limit is turned into the largest integer level
the validator accepts (``limit * (1 + 1e-9) + 1e-12``). Every returned schedule is
re-simulated and validated; its value must equal the CP objective.
"""

from __future__ import annotations

import atexit
import itertools
import math
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

from zbsearch import CostModel, Profile, StageCost
from zbsearch.actions import RECOMPUTES, Action, Op
from zbsearch.dependencies import predecessors
from zbsearch.errors import ZbError
from zbsearch.formats.schedule import Schedule
from zbsearch.layout import placement
from zbsearch.simulator import Deadlock, simulate
from zbsearch.validator import find_problem

__all__ = [
    "OracleResult", "Instance", "cp_optimum", "cp_optimum_many", "brute_force", "schedule_value", "memory_level",
    "random_instance", "with_fused", "with_recompute", "issue_counterexample", "FAMILIES",
]

_MEM_RTOL = 1e-9  # the validator's tolerance (validator._MEM_RTOL), restated: the oracle is its own
_OPS = (Op.F, Op.B, Op.W)
Pass = tuple[int, Op, int]


@dataclass(frozen=True)
class OracleResult:
    value: float  # the optimum (exact rational, as a float)
    rows: list[list[Action]]  # an optimal schedule, validated
    optimal: bool  # False: CP-SAT ran out of time, value is only an upper bound
    bound: float  # CP-SAT's proven lower bound (== value when optimal)


@dataclass(frozen=True)
class Instance:
    """A generated problem: profile, microbatches, placement, per-rank limit (None: unlimited)."""

    family: str
    profile: Profile
    m: int
    chunks: int
    limit: list[float] | None
    limit_name: str

    @property
    def stage_to_rank(self) -> list[int]:
        return list(range(self.profile.num_stages)) if self.chunks == 1 else placement(self.profile.num_stages, 2, "v")

    @property
    def cost(self) -> CostModel:
        return CostModel.from_profile(self.profile, self.stage_to_rank)


def schedule_value(rows: list[list[Action]], cost: CostModel, objective: str) -> float:
    tl = simulate(rows, cost)
    if objective == "iteration":  # the span, then the reductions the passes leave and the optimizer steps
        return tl.period
    return max(tl.span) if objective == "span" else tl.makespan


def memory_level(limit: float, scale: int) -> int:
    """The largest integer memory level (in units of 1/scale) the validator accepts under ``limit``."""
    allowed = limit * (1 + _MEM_RTOL) + 1e-12
    level = math.floor(allowed * scale)
    while (level + 1) / scale <= allowed:
        level += 1
    while level / scale > allowed:
        level -= 1
    return level


def _scale(values: list[float]) -> int:
    den = 1
    for v in values:
        f = Fraction(v).limit_denominator(10**6)
        assert abs(float(f) - v) <= 1e-12 * max(1.0, abs(v)), f"{v!r} is not on a rational grid"
        den = math.lcm(den, f.denominator)
    assert den <= 10**6, f"grid too fine for an exact integer model (1/{den})"
    return den


def _to_int(v: float, scale: int) -> int:
    x = round(v * scale)
    assert abs(x - v * scale) <= 1e-6, (v, scale)
    return x


def _passes(cost: CostModel, m: int, rank: int, recompute: bool = False) -> list[Pass]:
    """The rank's F, B, W nodes and, with ``recompute``, one node per recompute pass offered."""
    out = [(s, op, j) for s in cost.rank_stages(rank) for op in _OPS for j in range(m)]
    if recompute:
        out += [(s, op, j) for s in cost.rank_stages(rank) for op in cost.recompute_ops(s) for j in range(m)]
    return out


def _deps(cost: CostModel, p: Pass) -> list[tuple[Pass, float]]:
    """(dependency, delay): the simulator's rule, comm only between different stages."""
    s, op, j = p
    return [((ds, dop, dj), cost.comm(ds, s) if ds != s else 0.0)
            for ds, dop, dj in predecessors(s, op, j, cost.num_stages)]


def _ancestors(cost: CostModel, m: int) -> dict[Pass, set[Pass]]:
    """Per node, the nodes that must come before it: its dependencies and, for a backward, the
    recompute nodes of its own (stage, microbatch) (before it where present)."""
    S = cost.num_stages
    order = [(s, Op.F, j) for j in range(m) for s in range(S)]
    order += [(s, op, j) for j in range(m) for s in range(S) for op in RECOMPUTES]
    order += [(s, Op.B, j) for j in range(m) for s in reversed(range(S))]
    order += [(s, Op.W, j) for j in range(m) for s in range(S)]
    anc: dict[Pass, set[Pass]] = {}
    for p in order:
        a: set[Pass] = set()
        for d, _ in _deps(cost, p):
            a |= anc[d] | {d}
        if p[1] is Op.B:
            for op in RECOMPUTES:
                a |= anc[(p[0], op, p[2])] | {(p[0], op, p[2])}
        anc[p] = a
    return anc


def cp_optimum(
    cost: CostModel, m: int, limit: list[float] | None, objective: str = "span", *,
    rank: int | None = None, semantics: str = "asap", fifo: bool = False, fused: bool = False,
    recompute: bool = False, time_limit: float = 60.0,
) -> OracleResult:
    """Least ``objective`` over all schedules within ``limit``.

    ``rank``: minimise that rank's span instead (a per-rank bound must not exceed it).
    ``semantics``: "asap" (the simulator's timeline, the truth) or "idle" (passes may wait
    longer than needed: a lower bound on the ASAP optimum, equal to it for makespan).
    ``time_limit``: CP-SAT's deterministic time limit, so that whether an instance is proven
    does not depend on how busy the machine is.
    ``fifo``: only schedules running each stage's F, B and W passes in microbatch order (what
    zbsearch's MILP assumes), to tell a wrong assumption from a wrong solve.
    ``fused``: over split, fused and mixed schedules (each backward one BW or a B then a W);
    otherwise over split schedules only (B and W everywhere).
    ``recompute``: over every choice of recomputation the costs offer, per (stage, microbatch);
    otherwise none.

    CP-SAT runs in a separate process: ortools bundles its own libhighs.so.1 (HiGHS 1.12),
    which cannot share a process with highspy's (1.15), whichever is imported first."""
    return cp_optimum_many([(cost, m, limit, objective, dict(rank=rank, semantics=semantics, fifo=fifo, fused=fused,
                                                               recompute=recompute))], time_limit=time_limit)[0]


def cp_optimum_many(jobs, *, time_limit: float = 60.0, processes: int = 1) -> list[OracleResult]:
    """``cp_optimum`` for each (cost, m, limit, objective, options), ``processes`` at a time."""
    pool = _pool(processes)
    futures = [pool.submit(_cp_solve, cost, m, limit, objective, time_limit=time_limit, **opts)
               for cost, m, limit, objective, opts in jobs]
    try:
        results = [f.result() for f in futures]
    finally:
        for f in futures:  # on an error, leave no queued work behind in the pool
            f.cancel()
    out = []
    for (cost, m, limit, objective, opts), (value, rows, optimal, bound) in zip(jobs, results):
        _check(rows, cost, m, limit)
        tl = simulate(rows, cost)
        rank, semantics = opts.get("rank"), opts.get("semantics", "asap")
        got = tl.span[rank] if rank is not None else (max(tl.span) if objective == "span" else tl.makespan)
        close = math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-9)
        if semantics == "asap" and objective == "span":
            assert close, (got, value)  # every CP solution is the ASAP timeline of its orders
        elif objective == "makespan":  # the idle model: its orders' ASAP timeline is no longer
            assert close or (not optimal and got < value), (got, value)
        out.append(OracleResult(value, rows, optimal, bound))
    return out


_POOLS: dict[int, ProcessPoolExecutor] = {}


def _pool(processes: int) -> ProcessPoolExecutor:
    if processes not in _POOLS:
        _POOLS[processes] = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_POOLS[processes].shutdown)
    return _POOLS[processes]


def _cp_solve(cost: CostModel, m: int, limit: list[float] | None, objective: str, *, rank: int | None = None,
              semantics: str = "asap", fifo: bool = False, fused: bool = False, recompute: bool = False,
              time_limit: float = 60.0):
    """The CP-SAT model (module docstring); runs in a worker process. Returns (value, rows,
    optimal, bound). Nodes are basic passes (s, op, j); with ``fused`` the node (s, B, j) is the
    backward, a B or (when fused) a BW, and (s, W, j) is absent when fused."""
    from ortools.sat.python import cp_model

    assert objective in ("span", "makespan") and semantics in ("asap", "idle")
    if objective == "makespan":
        semantics = "idle"  # equal optimum (module docstring), smaller model
    R = cost.num_ranks
    passes = [_passes(cost, m, r, recompute) for r in range(R)]
    all_passes = [p for row in passes for p in row]
    times = [cost.time(s, op) for s, op, _ in all_passes] + list(cost.comm_next)
    if fused:
        times += list(cost.t_bw) + list(cost.t_ff)
    offers = {(s, op): cost.offer(s, op) for s, op, _ in all_passes if op in RECOMPUTES}
    times += [o.t_f for o in offers.values()]  # type: ignore[union-attr]
    assert all(t > 0 for t in times[:len(all_passes)]), "pass times must be positive"
    assert not fused or min(cost.t_bw + cost.t_ff) > 0, "pass times must be positive"
    ts = _scale(times)
    model = cp_model.CpModel()
    # x[(s, j)]: the backward of microbatch j on stage s is fused (a constant 0 without ``fused``)
    x = {(s, j): (model.new_bool_var(f"x{s}_{j}") if fused else 0) for s in range(cost.num_stages) for j in range(m)}
    # y[(s, op, j)]: microbatch j is recomputed on stage s by ``op`` (R or RS), at most one per (s, j)
    y = {p: model.new_bool_var(f"y{p}") for p in all_passes if p[1] in RECOMPUTES}
    for s in range(cost.num_stages):
        for j in range(m):
            lits = [y[(s, op, j)] for op in RECOMPUTES if (s, op, j) in y]
            if len(lits) > 1:
                model.add_at_most_one(lits)
    # z[(s, j)]: fused and not checkpointed, the only case where F costs t_ff
    z = {}
    if fused:
        for (s, j), lit in x.items():
            ys = [y[(s, op, j)] for op in RECOMPUTES if (s, op, j) in y]
            if not ys:
                z[(s, j)] = lit
                continue
            z[(s, j)] = model.new_bool_var(f"z{s}_{j}")
            model.add_implication(z[(s, j)], lit)
            for v in ys:
                model.add_implication(z[(s, j)], v.Not())
            model.add_bool_or([lit.Not(), *ys, z[(s, j)]])

    def scaled(v: float) -> int:
        return _to_int(v, ts)

    def duration(p: Pass):
        """The pass's duration: a constant, or affine in its microbatch's literals."""
        s, op, j = p
        if op in RECOMPUTES:
            return scaled(cost.time(s, op)) * y[p]
        base = scaled(cost.time(s, op))
        out = base
        if fused:
            other = {Op.F: scaled(cost.t_ff[s]), Op.B: scaled(cost.t_bw[s]), Op.W: 0}[op]
            out = base + (other - base) * (z[(s, j)] if op is Op.F else x[(s, j)])
        if op is Op.F:
            for r_op in RECOMPUTES:
                if (s, r_op, j) in y:
                    out = out + (scaled(offers[(s, r_op)].t_f) - base) * y[(s, r_op, j)]  # type: ignore[union-attr]
        return out

    def longest(p: Pass) -> int:
        s, op, _ = p
        out = scaled(cost.time(s, op))
        if fused and op in (Op.F, Op.B):
            out = max(out, scaled(cost.t_ff[s] if op is Op.F else cost.t_bw[s]))
        if op is Op.F:
            out = max([out] + [scaled(offers[(s, r_op)].t_f) for r_op in RECOMPUTES if (s, r_op) in offers])  # type: ignore[union-attr]
        return out

    def present(p: Pass):
        """1 where the pass runs, or the literal saying so (a fused microbatch has no W, a
        microbatch not recomputed no recompute pass)."""
        s, op, j = p
        if op in RECOMPUTES:
            return y[p]
        return 1 if op is not Op.W or not fused else x[(s, j)].Not()

    def optional(p: Pass) -> bool:
        return p[1] in RECOMPUTES or (fused and p[1] is Op.W)

    dur = {p: duration(p) for p in all_passes}
    horizon = sum(longest(p) for p in all_passes) + sum(scaled(c) for c in cost.comm_next) * m * 2 + 1
    start = {p: model.new_int_var(0, horizon, f"s{p}") for p in all_passes}
    end = {p: start[p] + dur[p] for p in all_passes}
    if fused or y:  # an interval's size and end must each be one variable (or a constant) plus a constant
        for p in all_passes:
            if not isinstance(dur[p], int):
                d = model.new_int_var(0, longest(p), f"d{p}")
                model.add(d == dur[p])
                dur[p] = d
            e = model.new_int_var(0, horizon + longest(p), f"e{p}")
            model.add(e == start[p] + dur[p])
            end[p] = e
    for p in all_passes:
        for d, delay in _deps(cost, p):
            model.add(start[p] >= end[d] + scaled(delay))
    for (s_, op, j), lit in y.items():  # a recompute pass before its backward, on their rank
        model.add(start[(s_, Op.B, j)] >= end[(s_, op, j)]).only_enforce_if(lit)
        model.add(start[(s_, op, j)] == end[(s_, Op.F, j)]).only_enforce_if(lit.Not())  # absent: no length, at F's end
    if fifo:
        for s_, op, j in all_passes:
            if j and op not in RECOMPUTES:
                model.add(start[(s_, op, j)] >= end[(s_, op, j - 1)])
    for r in range(R):
        model.add_no_overlap([
            model.new_optional_interval_var(start[p], dur[p], end[p], present(p), f"i{p}")
            if optional(p) else model.new_interval_var(start[p], dur[p], end[p], f"i{p}")
            for p in passes[r]
        ])
    fixed = {p: scaled(cost.time(p[0], p[1])) if p[1] not in RECOMPUTES else 0 for p in all_passes}
    hint = _sequential_hint(cost, m, fixed, {p: {d: scaled(c) for d, c in _deps(cost, p)} for p in all_passes})
    for p in all_passes:
        if p[1] in RECOMPUTES:  # absent in the hint: at its F's end, no length
            f = (p[0], Op.F, p[2])
            hint[p] = hint[f] + fixed[f]
        model.add_hint(start[p], hint[p])
    if fused:
        for v in x.values():
            model.add_hint(v, False)  # the hint is the split sequential schedule
    for v in y.values():
        model.add_hint(v, False)  # ... without recomputation
    if semantics == "asap":
        anc = _ancestors(cost, m)
        for r in range(R):
            nodes = passes[r]
            arcs = []
            prev_end = {p: model.new_int_var(0, horizon, f"pe{p}") for p in nodes}
            hinted_nodes = [u for u in nodes if u[1] not in RECOMPUTES]  # the hint has no recompute pass
            for i, v in enumerate(nodes):
                if optional(v):
                    gone = x[(v[0], v[2])] if v[1] is Op.W else y[v].Not()
                    arcs.append((i + 1, i + 1, gone))  # a fused W or an absent recompute pass is not visited
                    # ... and then sits at its backward's (its F's) end: no free variable left
                    model.add(prev_end[v] == 0).only_enforce_if(gone)
                in_hint = v[1] not in RECOMPUTES
                first = model.new_bool_var(f"first{v}")
                arcs.append((0, i + 1, first))
                model.add(prev_end[v] == 0).only_enforce_if(first)
                pred = [u for u in hinted_nodes if hint[u] < hint[v]] if in_hint else []
                hinted = max(pred, key=hint.get) if pred else None
                model.add_hint(first, in_hint and hinted is None)
                model.add_hint(prev_end[v], hint[hinted] + fixed[hinted] if hinted else 0)
                last_lit = model.new_bool_var(f"last{v}")
                arcs.append((i + 1, 0, last_lit))
                model.add_hint(last_lit, in_hint and all(hint[u] <= hint[v] for u in hinted_nodes))
                for k, u in enumerate(nodes):
                    if u == v or v in anc[u]:  # v must come before u: no arc u -> v
                        continue
                    lit = model.new_bool_var(f"a{u}{v}")
                    arcs.append((k + 1, i + 1, lit))
                    model.add_hint(lit, in_hint and u == hinted)
                    model.add(prev_end[v] == end[u]).only_enforce_if(lit)
                # the simulator's recurrence: start = max(previous end on the rank, ready times)
                model.add_max_equality(start[v], [prev_end[v], *(end[d] + scaled(c) for d, c in _deps(cost, v))])
            model.add_circuit(arcs)
    elif fused:
        for p in all_passes:  # an absent W sits at its backward's end, as under "asap"
            if p[1] is Op.W:
                model.add(start[p] == end[(p[0], Op.B, p[2])]).only_enforce_if(x[(p[0], p[2])])
    if limit is not None:
        ms = _scale([cost.memory(s, op) for s, op, _ in all_passes] + [o.keep for o in offers.values()])  # type: ignore[union-attr]
        for r in range(R):
            # one event per pass at its start; a fused backward changes memory by its W's change
            # as well, at once, and its absent W changes nothing
            times_, deltas = [], []
            for p in passes[r]:
                s, op, j = p
                delta = _to_int(cost.memory(s, op), ms)
                times_.append(start[p])
                if op in RECOMPUTES:
                    delta = delta * y[p]  # what the checkpointed F did not keep, if recomputed
                elif op is Op.F:
                    for r_op in RECOMPUTES:
                        if (s, r_op, j) in y:
                            keep = _to_int(offers[(s, r_op)].keep, ms)  # type: ignore[union-attr]
                            delta = delta + (keep - _to_int(cost.m_f[s], ms)) * y[(s, r_op, j)]
                elif fused:
                    w = _to_int(cost.memory(s, Op.W), ms)
                    # the backward takes its W's change too when fused; an absent W none
                    delta = delta + w * x[(s, j)] if op is Op.B else w - w * x[(s, j)]
                if not isinstance(delta, int):  # a level change may hold one variable only
                    bound = sum(abs(_to_int(cost.memory(s, o), ms)) for o in (Op.F, Op.B, Op.W))
                    v = model.new_int_var(-bound, bound, f"dm{p}")
                    model.add(v == delta)
                    delta = v
                deltas.append(delta)
            top = memory_level(limit[r], ms)
            if top < 0:
                raise ValueError("no schedule meets the memory limit")
            # balanced memory never goes below 0; the floor only satisfies the API
            floor = -sum(abs(_to_int(cost.memory(s, op), ms)) for s, op, _ in passes[r])
            model.add_reservoir_constraint(times_, deltas, floor, top)
    first = [model.new_int_var(0, horizon, f"first{r}") for r in range(R)]
    last = [model.new_int_var(0, horizon, f"last{r}") for r in range(R)]
    for r in range(R):
        # an absent W starts and ends at its backward's end: it changes neither the first
        # start nor the last end of its rank
        model.add_min_equality(first[r], [start[p] for p in passes[r]])
        model.add_max_equality(last[r], [end[p] for p in passes[r]])
        model.add(last[r] - first[r] >= sum(dur[p] for p in passes[r]))  # redundant: busy time
    obj = model.new_int_var(0, horizon, "obj")
    if rank is not None:
        model.add(obj == last[rank] - first[rank])
    elif objective == "span":
        for r in range(R):
            model.add(obj >= last[r] - first[r])
    else:
        lo, hi = model.new_int_var(0, horizon, "lo"), model.new_int_var(0, horizon, "hi")
        model.add_min_equality(lo, first)
        model.add_max_equality(hi, last)
        model.add(obj == hi - lo)
    model.minimize(obj)
    solver = cp_model.CpSolver()
    # deterministic time (about seconds of one idle core): results do not depend on the load
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.num_workers = 1  # deterministic; parallelism comes from several processes
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        raise ValueError("no schedule meets the memory limit")
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), solver.status_name(status)
    rows = []
    for r in range(R):
        row = []
        def order(p: Pass):  # at one instant: an F before an absent recompute pass, a fused W last
            return solver.value(start[p]), p[1] is Op.W, p[1] is not Op.F

        for s, op, j in sorted(passes[r], key=order):
            is_fused = fused and solver.value(x[(s, j)])
            if (is_fused and op is Op.W) or (op in RECOMPUTES and not solver.value(y[(s, op, j)])):
                continue
            row.append(Action(s, Op.BW if is_fused and op is Op.B else op, j))
        rows.append(row)
    return solver.objective_value / ts, rows, status == cp_model.OPTIMAL, solver.best_objective_bound / ts


def _sequential_hint(cost: CostModel, m: int, dur: dict, delay: dict) -> dict[Pass, int]:
    """ASAP starts of the schedule that runs microbatch after microbatch on every rank (valid at
    the smallest limit): a feasible point for CP-SAT to start from, computed in one sweep because
    microbatch-major dependency order is consistent with every rank's order."""
    free = [0] * cost.num_ranks
    start: dict[Pass, int] = {}
    S = cost.num_stages
    for j in range(m):
        for p in [(s, Op.F, j) for s in range(S)] + [(s, Op.B, j) for s in reversed(range(S))] + \
                 [(s, Op.W, j) for s in range(S)]:
            r = cost.stage_to_rank[p[0]]
            start[p] = max([free[r], *(start[d] + dur[d] + c for d, c in delay[p].items())])
            free[r] = start[p] + dur[p]
    return start


def _check(rows: list[list[Action]], cost: CostModel, m: int, limit: list[float] | None) -> None:
    """The validator accepts the schedule (complete, no deadlock, within the limit)."""
    sched = Schedule.build("oracle", _profile_of(cost), m, list(cost.stage_to_rank), rows, memory_limit=limit)
    problem = find_problem(sched)
    assert problem is None, problem


def _profile_of(cost: CostModel) -> Profile:
    """A profile whose cost model under ``cost.stage_to_rank`` is ``cost`` (one profile stage per
    virtual stage, the comm list as it is), for the validator."""
    def offers(s: int) -> dict:
        out = {}
        for op, (t_fc, t_r, m_fc) in ((Op.R, ("t_fc", "t_r", "m_fc")), (Op.RS, ("t_fs", "t_rs", "m_fs"))):
            o = cost.offer(s, op)
            if o is not None:
                out.update({t_fc: o.t_f, t_r: o.t_r, m_fc: o.keep})
        return out

    stages = [StageCost(t_f=cost.t_f[s], t_b=cost.t_b[s], t_w=cost.t_w[s], m_f=cost.m_f[s], m_b=cost.m_b[s],
                        m_w=cost.m_w[s], t_bw=cost.t_bw[s], t_ff=cost.t_ff[s], **offers(s)) for s in range(cost.num_stages)]
    return Profile(name="oracle-check", memory_unit="activations", stages=stages,
                   t_comm=list(cost.comm_next) if cost.num_stages > 1 else 0.0)


def _rank_orders(cost: CostModel, m: int, rank: int, limit: float | None, fused: frozenset = frozenset(),
                 recomputed: frozenset = frozenset()):
    """Every order of the rank's actions that respects its own dependencies and memory limit;
    the backward of each (stage, microbatch) in ``fused`` is one BW action, the others a B and a W;
    each (stage, op, microbatch) in ``recomputed`` a recompute pass (its F checkpointed)."""
    stages = set(cost.rank_stages(rank))
    mine_r = {p for p in recomputed if p[0] in stages}
    nodes = [p for p in _passes(cost, m, rank) if not (p[1] is Op.W and (p[0], p[2]) in fused)] + sorted(mine_r)
    anc = _ancestors(cost, m)
    mine = set(_passes(cost, m, rank)) | mine_r
    local = {p: anc[p] & mine for p in nodes}
    keep = {(s, j): cost.offer(s, op).keep for s, op, j in mine_r}  # type: ignore[union-attr]
    allowed = None if limit is None else limit * (1 + _MEM_RTOL) + 1e-12
    out: list[list[Action]] = []

    def action(p: Pass) -> Action:
        s, op, j = p
        return Action(s, Op.BW if op is Op.B and (s, j) in fused else op, j)

    def grow(prefix: list[Pass], done: set[Pass], mem: float) -> None:
        if len(prefix) == len(nodes):
            out.append([action(p) for p in prefix])
            return
        for p in nodes:
            if p in done or not local[p] <= done:
                continue
            whole = p[1] is Op.B and (p[0], p[2]) in fused  # a BW: B and W at once
            delta = keep[(p[0], p[2])] if p[1] is Op.F and (p[0], p[2]) in keep else cost.memory(p[0], p[1])
            nxt = mem + delta + (cost.memory(p[0], Op.W) if whole else 0.0)
            if allowed is not None and nxt > allowed:
                continue
            added = [p] + ([(p[0], Op.W, p[2])] if whole else [])
            done.update(added)
            prefix.append(p)
            grow(prefix, done, nxt)
            prefix.pop()
            done.difference_update(added)

    grow([], set(), 0.0)
    return out


def _in_microbatch_order(row: list[Action]) -> bool:
    """Whether each stage's forwards, its backwards (B or BW) and its W passes run in microbatch order."""
    seen: dict[tuple[int, Op], int] = {}
    for a in row:
        key = (a.stage, Op.B if a.op is Op.BW else a.op)
        if seen.get(key, -1) > a.mb:
            return False
        seen[key] = a.mb
    return True


def brute_force(cost: CostModel, m: int, limit: list[float] | None, objective: str = "span",
                max_combinations: int = 300_000, fused: bool = False,
                recompute: bool = False, fifo: bool = False) -> tuple[float, list[list[Action]]]:
    """Least ``objective`` over every combination of per-rank orders, each simulated; with
    ``fused``, for every subset of fused (stage, microbatch) backwards as well; with
    ``recompute``, for every choice of recomputation (none or an offered pass) per (stage,
    microbatch); with ``fifo``, over the orders that run each stage's forwards, backwards and
    W passes in microbatch order only."""
    keys = [(s, j) for s in range(cost.num_stages) for j in range(m)]
    subsets = [frozenset(k for k, bit in zip(keys, bits) if bit)
               for bits in itertools.product((0, 1), repeat=len(keys) if fused else 0)]
    choices = [[None, *(cost.recompute_ops(s) if recompute else ())] for s, _ in keys]
    plans = [frozenset((s, op, j) for (s, j), op in zip(keys, pick) if op is not None)
             for pick in itertools.product(*choices)]
    best, best_rows = math.inf, None
    total = 0
    for chosen, plan in itertools.product(subsets, plans):
        orders = [_rank_orders(cost, m, r, None if limit is None else limit[r], chosen, plan)
                  for r in range(cost.num_ranks)]
        if fifo:
            orders = [[row for row in rank if _in_microbatch_order(row)] for rank in orders]
        total += math.prod(len(o) for o in orders)
        assert total <= max_combinations, f"over {max_combinations} combinations"
        for combo in itertools.product(*orders):
            rows = list(combo)
            try:
                value = schedule_value(rows, cost, objective)
            except Deadlock:
                continue
            if value < best:
                best, best_rows = value, rows
    assert best_rows is not None
    _check(best_rows, cost, m, limit)
    return best, best_rows


# ---------------------------------------------------------------------------------------------
# Instance families (all on dyadic grids: exact in floats and in the integer model).

def _grid(rng: random.Random, lo: float, hi: float, step: float) -> float:
    return step * rng.randint(math.ceil(lo / step), math.floor(hi / step))


def _stage(rng: random.Random, t_f: float, t_b: float, t_w: float) -> StageCost:
    m_f = _grid(rng, 0.5, 1.0, 1 / 32)
    m_w = _grid(rng, 1 / 32, m_f - 1 / 32, 1 / 32)  # W frees this much, B the rest
    return StageCost(t_f=t_f, t_b=t_b, t_w=t_w, m_f=m_f, m_b=-(m_f - m_w), m_w=-m_w)


def _times(rng: random.Random, family: str, p: int) -> list[tuple[float, float, float]]:
    g = 1 / 16
    if family == "uniform":
        return [(1.0, 1.0, _grid(rng, 0.5, 1.0, 0.25))] * p
    if family == "hetero":
        return [(_grid(rng, 0.25, 3, g), _grid(rng, 0.25, 3, g), _grid(rng, 0.125, 3, g)) for _ in range(p)]
    if family == "heavy":  # one rank with big B/W behind slow forwards
        heavy = rng.randrange(1, p)
        out = []
        for s in range(p):
            f, b, w = (_grid(rng, 0.5, 1.5, g) for _ in range(3))
            if s < heavy:
                f = _grid(rng, 1.5, 3, g)
            if s == heavy:
                b, w = _grid(rng, 2, 4, g), _grid(rng, 2, 5, g)
            out.append((f, b, w))
        return out
    raise ValueError(family)


FAMILIES = ("uniform", "hetero", "heavy")


def random_instance(rng: random.Random, family: str, p: int, m: int, chunks: int, limit_name: str) -> Instance:
    """A ``family`` instance with per-link comm; ``limit_name``: 'min' (smallest feasible:
    one microbatch's activations per rank), 'none', or '<x>p' (x * p * M_B per rank)."""
    stages = [_stage(rng, *t) for t in _times(rng, family, p)]
    comm = [_grid(rng, 0, 0.5, 1 / 16) for _ in range(p - 1)]
    if chunks == 2 and p > 2 and sum(comm) * 16 % (p - 1):
        # splits inside a profile stage cost the mean comm: keep it on the 1/16 grid
        comm[-1] += ((p - 1) - sum(comm) * 16 % (p - 1)) / 16
    prof = Profile(name=f"{family}-p{p}", memory_unit="activations", stages=stages, t_comm=comm if p > 1 else 0.0)
    inst = Instance(family, prof, m, chunks, None, limit_name)
    cost = inst.cost
    if limit_name == "none":
        limit = None
    elif limit_name == "min":
        limit = [cost.activation_unit(r) for r in range(cost.num_ranks)]
    else:
        x = float(limit_name.removesuffix("p"))
        limit = [x * p * cost.activation_unit(r) for r in range(cost.num_ranks)]
    return Instance(family, prof, m, chunks, limit, limit_name)


def with_fused(rng: random.Random, inst: Instance, saving: tuple[float, float] = (0.0, 0.6)) -> Instance:
    """``inst`` with a fused backward on every stage cheaper than B + W by a share drawn from
    ``saving`` (t_bw = (1 - x)(t_b + t_w), on the 1/16 grid, at least 1/16) and a forward
    before it up to 10% cheaper than t_f (t_ff, on the grid too)."""
    g = 1 / 16
    stages = []
    for st in inst.profile.stages:
        x = rng.uniform(*saving)
        t_bw = max(g, round((1 - x) * (st.t_b + st.t_w) / g) * g)
        t_ff = max(g, st.t_f - _grid(rng, 0, 0.1 * st.t_f, g))
        stages.append(st.model_copy(update={"t_bw": t_bw, "t_ff": t_ff}))
    prof = inst.profile.model_copy(update={"stages": stages, "name": inst.profile.name + "-fused"})
    return Instance(inst.family, prof, inst.m, inst.chunks, inst.limit, inst.limit_name)


def with_recompute(rng: random.Random, inst: Instance, selective: bool = False) -> Instance:
    """``inst`` with full recomputation offered on every stage (keeping 1/32 to half of m_f,
    the checkpointed F up to 1/8 slower, the recompute pass 1/2 to 3/2 of t_f), and with
    ``selective`` selective recomputation too (keeping half to all but 1/32 of m_f, its pass 1/16
    to 1/2 of t_f), all on the instance's grids."""
    g = 1 / 16
    stages = []
    for st in inst.profile.stages:
        extra = {"t_fc": st.t_f + _grid(rng, 0, st.t_f / 8, g), "t_r": max(g, _grid(rng, st.t_f / 2, 1.5 * st.t_f, g)),
                 "m_fc": _grid(rng, 1 / 32, st.m_f / 2, 1 / 32)}
        if selective:
            extra.update({"t_rs": max(g, _grid(rng, st.t_f / 16, st.t_f / 2, g)),
                          "m_fs": _grid(rng, st.m_f / 2, st.m_f - 1 / 32, 1 / 32)})
        stages.append(st.model_copy(update=extra))
    prof = inst.profile.model_copy(update={"stages": stages, "name": inst.profile.name + "-recompute"})
    return Instance(inst.family, prof, inst.m, inst.chunks, inst.limit, inst.limit_name)


def issue_counterexample() -> Instance:
    """Issue 10's first example: 3 stages, m=2, no limit; zbsearch claims 13.56 optimal, a
    schedule of span 12.56 exists."""
    st = [(2.82, 0.56, 0.12, 0.75, -0.46875, -0.28125), (0.46, 1.76, 3.36, 0.75, -0.1875, -0.5625),
          (1.36, 0.18, 0.14, 0.5, -0.125, -0.375)]
    prof = Profile(name="issue10", memory_unit="activations", t_comm=[0.2, 0.16],
                   stages=[StageCost(t_f=a, t_b=b, t_w=c, m_f=d, m_b=e, m_w=f) for a, b, c, d, e, f in st])
    return Instance("issue", prof, 2, 1, None, "none")


# ---------------------------------------------------------------------------------------------
# Overlapped pairs: every choice of pairs on given per-rank orders.

def pairings(row: list[Action]) -> list[list[int]]:
    """Every set of non-overlapping pairs in ``row`` of a forward and the backward (B or BW) of
    another microbatch right after it."""
    out: list[list[int]] = []

    def rec(i: int, got: list[int]) -> None:
        if i >= len(row) - 1:
            out.append(list(got))
            return
        rec(i + 1, got)
        if row[i].op is Op.F and row[i + 1].op in (Op.B, Op.BW) and row[i].mb != row[i + 1].mb:
            rec(i + 2, [*got, i])

    rec(0, [])
    return out


def paired_optima(cost: CostModel, rows_per_rank: list[list[list[Action]]], limit) -> dict[str, float]:
    """The least span and the least makespan over every combination of the given per-rank rows
    and every choice of pairs on each (``pairings``), each simulated, within ``limit``."""
    best = {"span": math.inf, "makespan": math.inf}
    for tl in _paired_timelines(cost, rows_per_rank, limit):
        best["span"] = min(best["span"], max(tl.span))
        best["makespan"] = min(best["makespan"], tl.makespan)
    return best


def paired_rank_optima(cost: CostModel, rows_per_rank: list[list[list[Action]]], limit) -> list[float]:
    """Per rank, its least span over what ``paired_optima`` ranges over (what per-rank bounds
    are checked against)."""
    best = [math.inf] * cost.num_ranks
    for tl in _paired_timelines(cost, rows_per_rank, limit):
        best = [min(b, s) for b, s in zip(best, tl.span)]
    return best


def _paired_timelines(cost: CostModel, rows_per_rank: list[list[list[Action]]], limit):
    """The simulated timeline of every combination of the given per-rank rows and choice of pairs
    on each that runs within ``limit``."""
    per_rank = [[(row, pairs) for row in rows for pairs in pairings(row)] for rows in rows_per_rank]
    for combo in itertools.product(*per_rank):
        try:
            tl = simulate([c[0] for c in combo], cost, [c[1] for c in combo])
        except ZbError:
            continue
        if limit is None or all(p <= x + 1e-9 for p, x in zip(tl.peak_memory, limit)):
            yield tl
