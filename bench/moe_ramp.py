"""How far reasoning about one rank at a time can go on the MoE cases of ``bench/moe.py``.

The relaxation: rank r is the only machine; every pass on another rank takes its own time
(without all-to-all) as soon as its inputs are there, never waiting for its rank, and links
cost what they do in the simulator. On r, pairs and memory are the simulator's: a pair of a
forward and the backward of another microbatch takes ``CostModel.pair_time`` (both of its
passes end when it does), the forward's memory counts first, and memory after each pass stays
within DualPipeV's peak. Every schedule of the pipeline, seen from r, is one of this
relaxation's (the other ranks only add waits), so its least span on r is at least the
relaxation's optimum, and so is any bound that reasons from r's passes, r's memory and the
dependency paths alone (the pairing bound, and its windows however refined).

Randomised list schedules of the relaxation, each checked pass by pass (``_check``), give an
upper bound on that optimum per rank. Where it is below the span 1.2x ZB-V needs on every rank,
no one-rank bound can prove the case out of reach: only reasoning across ranks (a rank's pair
waiting for a neighbour's, whose pair waits in turn) can.

Run: PYTHONPATH=. python bench/moe_ramp.py [--tries 400] [--tries-first 3000]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402
from moe import profile  # noqa: E402

from zbsearch import CostModel, build_classic  # noqa: E402
from zbsearch.actions import Action, Op  # noqa: E402
from zbsearch.bounds import memory_span_lower_bound  # noqa: E402
from zbsearch.dependencies import earliest_starts, type_graph  # noqa: E402
from zbsearch.layout import placement  # noqa: E402

CASES = [(8, 16, 0.4), (8, 32, 0.3), (16, 32, 0.4), (16, 64, 0.3)]  # the open ones
TOL = 1e-9


def path_lags(cost: CostModel, mine: list[tuple[int, Op]]) -> dict[tuple[tuple[int, Op], tuple[int, Op]], float]:
    """Per two pass types of ``mine`` with a dependency path from the first to the second, the
    least time from the end of the first to the start of the second (one microbatch): the
    longest path, every pass on it taking its time alone, links their delay."""
    chain = cost.without_all_to_all()
    preds = type_graph(chain)
    out = {}
    for x in mine:
        rel = earliest_starts(chain, x, preds)
        for y in mine:
            if y != x and rel[y] > -math.inf:
                out[(x, y)] = rel[y] - chain.time(*x)
    return out


def _lags(cost: CostModel, r: int) -> dict[tuple[str, str], float]:
    """Rank r's stages a (low) and b (high): the least time from the end of one of its passes
    to the start of the next of the same microbatch on r, along the dependency path."""
    a, b = cost.rank_stages(r)
    fa, fb, bb, ba = (a, Op.F), (b, Op.F), (b, Op.B), (a, Op.B)
    lag = path_lags(cost, [fa, fb, bb, ba])
    return {("Fa", "Fb"): lag[(fa, fb)], ("Fb", "Bb"): lag[(fb, bb)], ("Bb", "Ba"): lag[(bb, ba)],
            ("Bb", "Wb"): 0.0, ("Ba", "Wa"): 0.0}


def _schedule(cost: CostModel, r: int, m: int, limit: float, lag: dict, rng: random.Random) -> list[tuple[float, list]] | None:
    """One randomised list schedule of the relaxation on rank r, (start, passes) per slot, with
    ``lag`` its ``_lags``; None where it runs into memory with nothing to free it."""
    a, b = cost.rank_stages(r)
    stage = {"Fa": a, "Ba": a, "Wa": a, "Fb": b, "Bb": b, "Wb": b}
    delta = {k: cost.memory(stage[k], Op[k[0]]) for k in stage}
    # the policy's knobs: forwards of stage a before the first B of a, how often a W goes first, how long a B waits
    # for an F, how long a forward of stage a waits for one of stage b
    warm = rng.randint(2, 2 * cost.num_ranks + 2)
    w_first, b_wait, f_wait = rng.random(), rng.choice([0.0, 0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.2, 0.5])
    late_a = rng.random() < 0.5  # whether the backwards of stage a go last (to fill the cool-down)
    ready = {("Fa", j): 0.0 for j in range(m)}
    done: set = set()
    out: list[tuple[float, list]] = []
    t = mem = 0.0
    while len(done) < 6 * m:
        def avail(kind: str, now: float = t) -> list:
            return [(k, j) for (k, j), v in ready.items() if k == kind and v <= now + TOL and (k, j) not in done]

        opened = sum(k == "Fa" for k, _ in done) < warm or any(k == "Ba" for k, _ in done)
        fs = [f for f in avail("Fb") + (avail("Fa") if opened else []) if mem + delta[f[0]] <= limit + TOL]
        bs = avail("Bb") + avail("Ba")
        if not late_a:
            rng.shuffle(bs)
        ws = avail("Wa") + avail("Wb")
        slot: tuple[list, float] | None = None
        if bs and fs:
            f = next((f for f in fs if f[1] != bs[0][1]), None)
            if f is not None:
                fa, ba = Action(stage[f[0]], Op.F, f[1]), Action(stage[bs[0][0]], Op.B, bs[0][1])
                slot = ([f, bs[0]], cost.pair_time(fa, ba, cost.t_f[fa.stage], cost.t_b[ba.stage]))
        if slot is None and ws and (rng.random() < w_first or not (bs or fs)):
            slot = ([ws[0]], cost.t_w[stage[ws[0][0]]])
        if slot is None and bs and late_a and bs[0][0] == "Ba" and ws:
            slot = ([ws[0]], cost.t_w[stage[ws[0][0]]])
        if slot is None and bs and not (fs and rng.random() < 0.5):
            soon = any(k[0][0] == "F" and k not in done and t < v <= t + b_wait for k, v in ready.items())
            if not soon or ws:
                slot = ([bs[0]], cost.t_b[stage[bs[0][0]]])
        if slot is None and fs and fs[0][0] == "Fa" and mem + delta["Fb"] <= limit + TOL:
            soon_b = [v for k, v in ready.items() if k[0] == "Fb" and k not in done and t < v <= t + f_wait]
            if soon_b:
                t = min(soon_b)
                continue
        if slot is None and fs:
            slot = ([fs[0]], cost.t_f[stage[fs[0][0]]])
        if slot is None:
            later = [v for k, v in ready.items() if k not in done and v > t + TOL]
            if not later:
                return None
            t = min(later)
            continue
        passes, d = slot
        out.append((t, passes))
        t += d
        for k, j in passes:
            done.add((k, j))
            mem += delta[k]
            for (x, y), g in lag.items():
                if x == k:
                    ready[(y, j)] = t + g
    return out


def _check(cost: CostModel, r: int, m: int, limit: float, slots: list[tuple[float, list]] | None) -> float:
    """The span of ``slots`` after checking it is a schedule of the relaxation: every pass once,
    slots apart, each pass after its predecessor on r by the lag, pairs of a forward and the
    backward of another microbatch, memory within ``limit`` after each pass (None: inf)."""
    if slots is None:
        return math.inf
    a, b = cost.rank_stages(r)
    stage = {"Fa": a, "Ba": a, "Wa": a, "Fb": b, "Bb": b, "Wb": b}
    lag = _lags(cost, r)
    end: dict = {}
    mem, last = 0.0, 0.0
    for start, passes in slots:
        assert start >= last - TOL
        if len(passes) == 2:
            (f, i), (bk, j) = passes
            assert f[0] == "F" and bk[0] == "B" and i != j
            d = cost.pair_time(Action(stage[f], Op.F, i), Action(stage[bk], Op.B, j), cost.t_f[stage[f]], cost.t_b[stage[bk]])
        else:
            d = cost.time(stage[passes[0][0]], Op[passes[0][0][0]])
        for k, j in passes:
            assert (k, j) not in end
            for (x, y), g in lag.items():
                if y == k:
                    assert start >= end[(x, j)] + g - TOL
            mem += cost.memory(stage[k], Op[k[0]])
            assert mem <= limit + TOL
        for p in passes:
            end[p] = start + d
        last = start + d
    assert len(end) == 6 * m
    return last - slots[0][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=400, help="list schedules per rank")
    ap.add_argument("--tries-first", type=int, default=3000, help="on rank 0 (the hardest to fill)")
    ap.add_argument("--case", type=int, help="only this one of CASES (index)")
    ap.add_argument("--ranks", type=int, help="only the first this many ranks")
    args = ap.parse_args()
    rows = []
    for p, m, share in CASES if args.case is None else [CASES[args.case]]:
        prof = profile(p, share)
        limit = max(build_classic("dualpipe-v", prof, m).predicted.peak_memory)
        need = max(build_classic("zb-v", prof, m).predicted.span) / 1.2
        cost = CostModel.from_profile(prof, placement(p, 2, "v"))
        bound = memory_span_lower_bound(cost, m, [limit] * p, quick=True)
        best = []
        for r in range(args.ranks or p):
            rng, lag = random.Random(r), _lags(cost, r)
            best.append(min(_check(cost, r, m, limit, _schedule(cost, r, m, limit, lag, rng))
                            for _ in range(args.tries_first if r == 0 else args.tries)))
        print(f"p={p} m={m} a2a {share:.0%}: 1.2x zb-v needs {need:.2f}, bound {bound:.2f}; one-rank relaxation "
              f"at most {max(best):.2f} on every rank (rank 0 {best[0]:.2f}, least {min(best):.2f}); "
              f"above it on ranks {[r for r, b in enumerate(best) if b > need]}", flush=True)
        rows.append({"p": p, "m": m, "a2a_share": share, "limit": limit, "needs": need, "bound": bound, "one_rank": best})
    save({"benchmark": "moe_ramp", "tries": args.tries, "tries_first": args.tries_first, "rows": rows}, "moe_ramp")


if __name__ == "__main__":
    main()
