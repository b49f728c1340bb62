"""Bounds across ranks on the MoE cases of ``bench/moe.py``: a rank's prefix, the others' machines.

``bench/moe_ramp.py`` shows that no bound reasoning from one rank alone (every other pass a
dependency delay) can decide the open cases. Two ways past it here, both in the idle relaxation
(a rank may start late, its span measured from its first pass), where FIFO orders lose nothing,
with pairs and memory too (``zbsearch.solver.problem``): each (stage, op) runs in microbatch
order, so a forward pairs only with a backward of an earlier microbatch. Backwards are split:
``_split_dominates`` checks that a fused BW (or a fused forward) is never better, and both
refuse costs where it could be. A pair that hides nothing is left out: its passes in turn are
no worse.

* ``prefix_bound``, the bound: a rank's span is at least its least busy time (``paired_floor``)
  plus what its unpaired passes keep plus its idle time, and a branch and bound finds the least
  its first T ms can lose, the other ranks relaxed to *machines*: each runs its forwards one at
  a time, and its backwards one at a time, each at least its time alone (``_releases``). In a V
  the middle rank runs two forwards per microbatch, so the last stage's forwards come no faster
  than one per two forward times, which no one-rank relaxation sees: the first rank's early
  pairs then lack partners. Tested against the exact oracle with pairs (two ranks) and against
  ``solve`` over every rank (three or four).
* ``solve``: an exact CP-SAT model of a set of ranks (as the simulator times and counts them:
  one pass at a time or an overlapped pair that starts both passes and ends both after
  ``CostModel.pair_time``; memory after each pass within the limit, the pair's forward counted
  first), every other rank a machine as above or only a delay (``moe_ramp.path_lags``). Over every rank it is
  the exact idle optimum (equal to the oracle's on the tests' instances); over two ranks of the
  open cases CP-SAT proves nothing in minutes, which is why the bound is the prefix search.

Run: PYTHONPATH=. python bench/moe_pair.py [--case 0] [--prefix 20 25 30] [--nodes 100000]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402
from moe import profile  # noqa: E402
from moe_ramp import CASES, path_lags  # noqa: E402

from zbsearch import CostModel, build_classic  # noqa: E402
from zbsearch.actions import Action, Op  # noqa: E402
from zbsearch.bounds import rank_pairing_span_lower_bounds  # noqa: E402
from zbsearch.dependencies import earliest_starts, edge_delay, predecessors, type_graph  # noqa: E402
from zbsearch.layout import placement  # noqa: E402
from zbsearch.limits import allowance  # noqa: E402

TOL = 1e-9
Pass = tuple[int, Op, int]  # (stage, op, microbatch)


@dataclass(frozen=True)
class Result:
    """The least largest span over ``ranks`` (``value``, None where no schedule was found) and
    CP-SAT's proven bound on it (``bound``, ms), with its status and the seconds it took."""

    ranks: tuple[int, ...]
    value: float | None
    bound: float
    status: str
    seconds: float
    pairs: int | None = None  # pairs in the best schedule found
    rows: tuple[tuple[tuple[float, Action, bool], ...], ...] | None = None  # per rank: (start, pass, paired) in time order


def _split_dominates(cost: CostModel) -> bool:
    """Whether split backwards lose nothing against fused ones on these costs: a BW takes at
    least B then W, alone and in a pair with any forward of its rank, a fused forward no less
    than a plain one, and a B frees memory (so the state after it never binds where the one
    after its pair's forward fits)."""
    for r in range(cost.num_ranks):
        stages = cost.rank_stages(r)
        for s in stages:
            if cost.t_bw[s] < cost.t_b[s] + cost.t_w[s] - TOL or cost.t_ff[s] < cost.t_f[s] - TOL or cost.memory(s, Op.B) > 0:
                return False
            for f in stages:
                fa, bw, b = Action(f, Op.F, 1), Action(s, Op.BW, 0), Action(s, Op.B, 0)
                fused, split = cost.pair_time(fa, bw, cost.t_f[f], cost.t_bw[s]), cost.pair_time(fa, b, cost.t_f[f], cost.t_b[s])
                if fused < split + cost.t_w[s] - TOL:
                    return False
    return not cost.can_recompute


def _scale(values: list[float]) -> int:
    """The least integer that makes every value whole (refused where one is off a fine grid)."""
    den = 1
    for v in values:
        f = Fraction(v).limit_denominator(10**6)
        if abs(float(f) - v) > 1e-9 * max(1.0, abs(v)):
            raise ValueError(f"{v!r} is not on a grid this model can scale exactly")
        den = math.lcm(den, f.denominator)
    return den


def solve(cost: CostModel, m: int, limit: list[float] | None, ranks: list[int], time_limit: float = 60.0,
          workers: int = 1, target: float | None = None, machines: bool = True, fifo: bool = True,
          pairs: bool = True) -> Result:
    """The relaxation on ``ranks`` (the module): CP-SAT's least largest span among them within
    ``limit`` (None: no limit) in ``time_limit`` seconds. ``machines``: every other rank runs its
    forwards one at a time and its backwards one at a time; else they only delay. ``target``: only whether
    the least exceeds it (``Result.bound`` just above it where proven, 0 where not). ``fifo``,
    ``pairs``: False to leave microbatch order free or to forbid pairs (for the tests)."""
    from ortools.sat.python import cp_model

    if not _split_dominates(cost):
        raise ValueError("fused passes may pay on these costs: this model splits every backward")
    ranks = sorted(set(ranks))
    stages = {s: r for r in ranks for s in cost.rank_stages(r)}
    types = [(s, op) for s in stages for op in (Op.F, Op.B, Op.W)]
    others = [(s, op) for s in range(cost.num_stages) if s not in stages for op in (Op.F, Op.B)] if machines else []
    lags = path_lags(cost, types)
    pt = {(f, b): cost.pair_time(Action(f, Op.F, 1), Action(b, Op.B, 0), cost.t_f[f], cost.t_b[b])
          for f in stages for b in stages if stages[f] == stages[b]}
    unit = _scale([cost.time(s, op) for s, op in types + others] + [cost.hideable(s, op) for s, op in types]
                  + list(lags.values()) + list(pt.values()) + [edge_delay(cost, a, a + 1) for a in range(cost.num_stages - 1)])
    mem_unit = _scale([cost.memory(s, op) for s, op in types])

    def q(v: float) -> int:
        return round(v * unit)

    horizon = 2 * m * sum(q(cost.time(s, op)) for s, op in types + others) + sum(max(0, q(v)) for v in lags.values()) + 1
    md = cp_model.CpModel()
    start: dict[Pass, cp_model.IntVar] = {}
    end: dict[Pass, cp_model.IntVar] = {}
    for s, op in types + others:
        for j in range(m):
            start[(s, op, j)] = md.NewIntVar(-horizon, horizon, f"s{s}{op.name}{j}")
            end[(s, op, j)] = md.NewIntVar(-horizon, horizon, f"e{s}{op.name}{j}")
    # overlapped pairs: y per forward and backward of an earlier microbatch (FIFO) on one rank
    y: dict[tuple[Pass, Pass], cp_model.IntVar] = {}
    if pairs and cost.has_all_to_all:
        for (f, b), t in pt.items():
            if q(t) >= q(cost.t_f[f]) + q(cost.t_b[b]):
                continue  # a pair that hides nothing
            for i in range(m):
                for j in range(m):
                    if j != i and (j < i or not fifo) and (f, Op.F, i) in start and (b, Op.B, j) in start:
                        y[((f, Op.F, i), (b, Op.B, j))] = md.NewBoolVar(f"y{f}_{i}_{b}_{j}")
    partners: dict[Pass, list[tuple[cp_model.IntVar, int]]] = {k: [] for k in start}
    for (fx, bx), v in y.items():
        t = q(pt[(fx[0], bx[0])])
        partners[fx].append((v, t))
        partners[bx].append((v, t))
        md.Add(start[fx] == start[bx]).OnlyEnforceIf(v)
    paired: dict[Pass, cp_model.IntVar] = {}
    dur: dict[Pass, cp_model.IntVar] = {}
    for k, ps in partners.items():
        alone = q(cost.time(k[0], k[1]))
        if ps:
            md.AddAtMostOne(v for v, _ in ps)
            paired[k] = md.NewBoolVar(f"p{k}")
            md.Add(paired[k] == sum(v for v, _ in ps))
        dur[k] = md.NewIntVar(min([alone] + [t for _, t in ps]), max([alone] + [t for _, t in ps]), f"d{k}")
        md.Add(dur[k] == alone + sum((t - alone) * v for v, t in ps))
        md.Add(end[k] == start[k] + dur[k])
    # each modelled rank's first start, the first forward of its lowest stage; time relative to the first's
    origin = {}
    for r in ranks:
        origin[r] = md.NewIntVar(-horizon, horizon, f"o{r}")
        md.AddMinEquality(origin[r], [start[(min(cost.rank_stages(r)), Op.F, j)] for j in range(m)])
    md.Add(origin[ranks[0]] == 0)

    def interval(k: Pass):
        if k[1] is Op.B and k in paired:  # paired, it runs in its forward's interval
            return md.NewOptionalIntervalVar(start[k], dur[k], end[k], paired[k].Not(), f"i{k}")
        return md.NewIntervalVar(start[k], dur[k], end[k], f"i{k}")

    for r in ranks:
        md.AddNoOverlap([interval(k) for k in start if cost.stage_to_rank[k[0]] == r])
    for r in sorted({cost.stage_to_rank[s] for s, _ in others}):
        for op in (Op.F, Op.B):
            md.AddNoOverlap([interval(k) for k in start if cost.stage_to_rank[k[0]] == r and k[1] is op])
    for (x, yy), lag in lags.items():
        for j in range(m):
            if (yy[0], yy[1], j) in start and (x[0], x[1], j) in start:
                md.Add(start[(yy[0], yy[1], j)] >= end[(x[0], x[1], j)] + q(lag))
    for s, op, j in start:
        for d in predecessors(s, op, j, cost.num_stages):
            if d in start:
                md.Add(start[(s, op, j)] >= end[d] + q(edge_delay(cost, d[0], s)))
    for k in start:
        if k[0] in stages:
            md.Add(start[k] >= origin[stages[k[0]]])
    if fifo:
        for s, op, j in start:
            if (s, op, j + 1) in start:
                md.Add(start[(s, op, j + 1)] >= end[(s, op, j)])
    # memory: after each pass, in the order the rank runs them (a pair's forward first)
    if limit is not None:
        for r in ranks:
            level = math.floor(allowance(limit[r]) * mem_unit + 1e-6)
            ev_t, ev_d = [], []
            for k in start:
                if stages.get(k[0]) == r:
                    s, op = k[0], k[1]
                    d = round(cost.memory(s, op) * mem_unit)
                    at = md.NewIntVar(-2 * horizon, 2 * horizon + 1, f"m{k}")
                    md.Add(at == 2 * start[k] + (paired[k] if op is Op.B and k in paired else 0))
                    ev_t.append(at)
                    ev_d.append(d)
            md.AddReservoirConstraint(ev_t, ev_d, -10**9, level)
    z = md.NewIntVar(0, 10 * horizon, "z")
    for k in start:
        if k[0] in stages:
            md.Add(z >= end[k] - origin[stages[k[0]]])
    cap = None if target is None else math.floor(target * unit + 1e-6)
    if cap is not None:
        md.Add(z <= cap)  # the question: is there a schedule within target?
    md.Minimize(z)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    t0 = time.perf_counter()
    status = solver.Solve(md)
    name, seconds = solver.StatusName(status), time.perf_counter() - t0
    if status == cp_model.INFEASIBLE:
        return Result(tuple(ranks), None, math.inf if cap is None else (cap + 1) / unit, name, seconds)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    bound = solver.BestObjectiveBound() / unit if cap is None else 0.0
    if not found:
        return Result(tuple(ranks), None, bound, name, seconds)
    def ran(k: Pass) -> tuple[float, Action, bool]:
        return solver.Value(start[k]) / unit, Action(k[0], k[1], k[2]), bool(k in paired and solver.Value(paired[k]))

    rows = tuple(tuple(sorted((ran(k) for k in start if stages.get(k[0]) == r), key=lambda e: (e[0], e[1].op is not Op.F)))
                 for r in ranks)
    return Result(tuple(ranks), solver.Value(z) / unit, bound, name, seconds, sum(solver.Value(v) for v in y.values()), rows)


def _releases(cost: CostModel, m: int, r: int, chains: list[tuple[int, Op]]) -> dict[tuple[int, Op], list[float]]:
    """Per pass type of rank r and microbatch j, the least time from r's first start to the
    start of its pass of j that another rank's machine allows. Rank q runs the passes of a set J
    of its forward (or backward) types, each reachable from r's first pass, one at a time in
    microbatch order per type, each taking its time alone at least (a pair no less): the
    passes of J of microbatches 0..j start no earlier than the least release among them and
    end one after another, the last a pass of j, whose path to the type still runs after it."""
    chain = cost.without_all_to_all()
    preds = type_graph(chain)
    rel = earliest_starts(chain, (min(cost.rank_stages(r)), Op.F), preds)
    out = {c: [0.0] * m for c in chains}
    for q in range(cost.num_ranks):
        if q == r:
            continue
        for op in (Op.F, Op.B):
            kinds = [(s, op) for s in cost.rank_stages(q) if rel[(s, op)] > -math.inf]
            for c in chains:
                lag = {x: earliest_starts(chain, x, preds)[c] - chain.time(*x) for x in kinds}
                for sub in (kinds, *([x] for x in kinds)):
                    sub = [x for x in sub if lag[x] > -math.inf]
                    if not sub:
                        continue
                    first, each, after = min(rel[x] for x in sub), sum(chain.time(*x) for x in sub), min(lag[x] for x in sub)
                    for j in range(m):
                        out[c][j] = max(out[c][j], first + (j + 1) * each + after)
    return out


def _unpaired(forwards: int, backwards: int) -> int:
    """The least number of unpaired forwards (and of backwards: a rank has as many of each) given
    how many of each start unpaired in the prefix."""
    return max(forwards, backwards)


@dataclass(frozen=True)
class Prefix:
    """``prefix_bound``'s answer: the rank's span bound (ms), whether the search completed (else
    the bound is only ``floor``: not proven), the nodes searched and the least prefix found."""

    bound: float
    complete: bool
    nodes: int
    floor: float
    slots: tuple[tuple[float, tuple[Action, ...]], ...] = ()


def prefix_bound(cost: CostModel, m: int, limit: list[float] | None, r: int, prefix: float, target: float | None = None,
                 machines: bool = True, max_nodes: int = 2_000_000) -> Prefix:
    """A lower bound on rank r's span from its first ``prefix`` ms (at most its least busy time).

    Its span is at least its least busy time (every forward and backward at ``paired_floor``)
    plus what its unpaired passes keep (as many forwards as backwards, at least as many as start
    unpaired in the prefix, ``_unpaired``) plus its idle time, at least the prefix's. A branch and
    bound over the orders of the prefix's slots (one pass, or a pair of a forward and a backward
    of an earlier microbatch) finds the least of that: each slot as early as the rank, memory,
    the lags from r's own passes (``moe_ramp.path_lags``) and the other ranks' machines (``_releases``, with
    ``machines``) let it, which starts every slot no later and covers no less of the prefix
    than any schedule with the same slots, and the least over every length of the order (the
    slots a schedule starts in the prefix). ``target``: stop once a prefix below it is found
    (then not complete). Off the search's ``max_nodes`` it is not complete either."""
    if not _split_dominates(cost):
        raise ValueError("fused passes may pay on these costs: this model splits every backward")
    stages = cost.rank_stages(r)
    chains = [(s, op) for s in stages for op in (Op.F, Op.B, Op.W)]
    floor = m * sum(cost.time(s, op) - cost.hideable(s, op) for s, op in chains)
    if prefix > floor + TOL:
        raise ValueError("a prefix longer than the least busy time: the rank may end in it")
    lags = path_lags(cost, chains)
    into = {c: [(x, g) for (x, y), g in lags.items() if y == c] for c in chains}
    ext = _releases(cost, m, r, chains) if machines else {c: [0.0] * m for c in chains}
    cap = math.inf if limit is None else allowance(limit[r])
    h = min(cost.hideable(s, Op.F) for s in stages) + min(cost.hideable(s, Op.B) for s in stages)
    fs, bs = [c for c in chains if c[1] is Op.F], [c for c in chains if c[1] is Op.B]
    pair = {(f, b): cost.pair_time(Action(f[0], Op.F, 1), Action(b[0], Op.B, 0), cost.t_f[f[0]], cost.t_b[b[0]])
            for f in fs for b in bs}
    saves = {f + b for (f, b), t in pair.items() if t < cost.t_f[f[0]] + cost.t_b[b[0]] - TOL}
    goal = -math.inf if target is None else target - floor
    best = [math.inf, ()]
    nodes = [0]
    ends: dict[tuple[int, Op], list[float]] = {c: [] for c in chains}
    trail: list = []

    def ready(c: tuple[int, Op]) -> float | None:
        j = len(ends[c])
        if j >= m:
            return None
        t = ext[c][j]
        for x, g in into[c]:
            if len(ends[x]) <= j:
                return None
            t = max(t, ends[x][j] + g)
        return t

    later = {c: [y for (x, y) in lags if x == c] for c in chains}
    seen: set = set()

    def visit(t: float, level: float, uf: int, ub: int, covered: float) -> bool:
        """False once the search should stop."""
        nodes[0] += 1
        if nodes[0] > max_nodes:
            return False
        # the same state reached by another order (the ends that some pass still waits for): its subtree is known
        live = tuple(tuple(round(e, 9) for j, e in enumerate(ends[c]) if any(len(ends[y]) <= j for y in later[c]))
                     for c in chains)
        key = (tuple(len(ends[c]) for c in chains), uf, ub, round(t, 9), round(covered, 9), live)
        if key in seen:
            return True
        seen.add(key)
        heads = {c: ready(c) for c in chains}
        options = []
        for f in fs:
            for b in bs:
                hf, hb = heads[f], heads[b]
                if hf is None or hb is None or len(ends[b]) >= len(ends[f]) or f + b not in saves:
                    continue  # (a pair takes a backward of an earlier microbatch, and saves time)
                if level + cost.memory(f[0], Op.F) > cap + TOL:
                    continue
                options.append((max(t, hf, hb), pair[(f, b)], (f, b), 0, 0, cost.memory(f[0], Op.F) + cost.memory(b[0], Op.B)))
        for c in chains:
            hc = heads[c]
            if hc is None or level + cost.memory(c[0], c[1]) > cap + TOL:
                continue
            kind = (int(c[1] is Op.F), int(c[1] is Op.B))
            options.append((max(t, hc), cost.time(c[0], c[1]), (c,), *kind, cost.memory(c[0], c[1])))
        options.sort(key=lambda o: (o[0] + o[1], -len(o[2])))
        for at, d, slot, df, db, dm in options:
            if at >= prefix - TOL:
                continue  # not in the prefix
            u2, f2, b2 = _unpaired(uf + df, ub + db), uf + df, ub + db
            cov = covered + min(at + d, prefix) - at
            idle = min(at + d, prefix) - cov
            if h * u2 + idle >= best[0] - TOL:
                continue  # no longer prefix of this one does better
            for c in slot:
                ends[c].append(at + d)
            trail.append((at, slot))
            g = h * u2 + prefix - cov
            if g < best[0] - TOL:
                best[0], best[1] = g, tuple(trail)
                if g < goal - TOL:
                    return False
            go = visit(at + d, level + dm, f2, b2, cov)
            trail.pop()
            for c in slot:
                ends[c].pop()
            if not go:
                return False
        return True

    complete = visit(0.0, 0.0, 0, 0, 0.0)
    shown = tuple((at, tuple(Action(c[0], c[1], len([1 for a2, s2 in best[1][:k] if c in s2])) for c in slot))
                  for k, (at, slot) in enumerate(best[1]))
    return Prefix(floor + best[0] if complete else floor, complete, nodes[0], floor, shown)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", type=int, nargs="*", help="these of moe_ramp.CASES (index; default all)")
    ap.add_argument("--prefix", type=float, nargs="+", default=[20.0, 25.0, 30.0, 40.0, 50.0, 60.0],
                    help="prefixes tried per rank (ms)")
    ap.add_argument("--nodes", type=int, default=200_000, help="the search's nodes per rank and prefix")
    args = ap.parse_args()
    rows = []
    for p, m, share in [CASES[i] for i in (args.case if args.case is not None else range(len(CASES)))]:
        prof = profile(p, share)
        limit = max(build_classic("dualpipe-v", prof, m).predicted.peak_memory)
        need = max(build_classic("zb-v", prof, m).predicted.span) / 1.2
        cost = CostModel.from_profile(prof, placement(p, 2, "v"))
        pairing = max(rank_pairing_span_lower_bounds(cost, m, [limit] * p))
        per_rank = []
        t0 = time.perf_counter()
        for r in range(p):
            tried = [(prefix_bound(cost, m, [limit] * p, r, t, max_nodes=args.nodes), t) for t in args.prefix]
            res, t = max(tried, key=lambda x: x[0].bound)
            per_rank.append({"rank": r, "bound": res.bound, "prefix": t, "nodes": res.nodes,
                             "complete": [x.complete for x, _ in tried],
                             "slots": [[a, [str(x) for x in sl]] for a, sl in res.slots]})
        best = max(per_rank, key=lambda x: x["bound"])
        print(f"p={p} m={m} a2a {share:.0%}: prefix bound {best['bound']:.2f} (rank {best['rank']}, "
              f"first {best['prefix']:g} ms), "
              f"pairing bound {pairing:.2f}; 1.2x zb-v needs {need:.2f}: "
              f"{'out of reach' if best['bound'] > need + TOL else 'open'} ({time.perf_counter() - t0:.1f} s)", flush=True)
        rows.append({"p": p, "m": m, "a2a_share": share, "limit": limit, "needs": need, "pairing_bound": pairing,
                     "bound": best["bound"], "out_of_reach": best["bound"] > need + TOL, "ranks": per_rank,
                     "seconds": time.perf_counter() - t0})
    save({"benchmark": "moe_pair", "prefixes": args.prefix, "nodes": args.nodes, "rows": rows}, "moe_pair")


if __name__ == "__main__":
    main()
