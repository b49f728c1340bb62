"""Measured steps of schedules with overlapped pairs: the runtime times a pair as one block (its
two passes from one start to one end), so ``pass_times`` compares each pair as one against the
cost model's pair time, and ``idle_time`` splits the wait before a pair by both passes' inputs.
Checked on traces made from the simulator's own timelines (which time a pair as the runtime
does), with passes held back by known amounts, and through ``zbsearch simulate --measured``."""

from __future__ import annotations

import json
import random

import pytest

import zbsearch as zb
from tests.helpers import run_main
from tests.test_idle_time import _trace
from zbsearch.actions import Op
from zbsearch.costs import CostModel
from zbsearch.dependencies import remote_input
from zbsearch.formats.trace import save_trace
from zbsearch.idle_time import measure_idle_time
from zbsearch.layout import placement
from zbsearch.pass_times import compare_pass_times
from zbsearch.solver.paired_v import paired_v


def _paired(n: int) -> list[zb.Schedule]:
    """DualPipeV with its pairs and the solver's paired V start, on MoE profiles of random costs."""
    rng = random.Random(11)
    out = []
    for k in range(n):
        p = rng.choice([2, 3])
        stages = []
        for _ in range(p):
            t_f, t_b = rng.uniform(1, 2), rng.uniform(1, 2.5)
            stages.append(zb.StageCost(t_f=t_f, t_b=t_b, t_w=rng.uniform(0.5, 1.5), m_f=1.0, m_b=-0.5, m_w=-0.5,
                                       a_f=t_f * rng.uniform(0.1, 0.5), a_b=t_b * rng.uniform(0.1, 0.5)))
        prof = zb.Profile(name=f"moe{k}", memory_unit="activations", stages=stages, t_comm=rng.choice([0.0, 0.1]))
        m = rng.choice([2 * p, 2 * p + 2])
        if k % 2:
            out.append(zb.build_classic("dualpipe-v", prof, m))
        else:
            v = placement(p, 2, "v")
            actions, pairs = paired_v(CostModel.from_profile(prof, v), m)
            out.append(zb.Schedule.build("paired-v", prof, m, v, actions, overlapped=pairs))
    assert all(s.num_pairs for s in out)
    return out


SCHEDULES = _paired(8)


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: f"{s.kind}-p{s.num_ranks}-m{s.num_microbatches}")
def test_pairs_are_compared_as_one_block_against_the_pair_time(sched):
    trace = _trace(sched)
    cost = CostModel.from_profile(sched.profile, sched.stage_to_rank)
    rows = compare_pass_times(sched, [trace, trace])
    for r, row in enumerate(sched.rank_actions):
        mine = {x.kind: x for x in rows if x.rank == r}
        pairs = [(row[i], row[i + 1]) for i in sched.pairs(r)]
        paired = {a for f, b in pairs for a in (f, b)}
        for op in Op:  # the passes no pair holds, by type, as before
            alone = [a for a in row if a.op is op and a not in paired]
            assert (mine[op.value].count if op.value in mine else 0) == 2 * len(alone)
        for kind in {f"F+{b.op.value}" for _, b in pairs}:
            mine_pairs = [(f, b) for f, b in pairs if f"F+{b.op.value}" == kind]
            x = mine[kind]
            assert x.count == 2 * len(mine_pairs) and x.pair is not None and x.op is Op.F
            want = sum(cost.pair_time(f, b, cost.time(f.stage, f.op), cost.time(b.stage, b.op)) for f, b in mine_pairs)
            assert x.predicted_ms == pytest.approx(want / len(mine_pairs))
            assert x.predicted_ms < sum(cost.time(f.stage, f.op) + cost.time(b.stage, b.op)
                                        for f, b in mine_pairs) / len(mine_pairs)  # the pairs hide all-to-all
        assert all(x.ratio == pytest.approx(1.0) for x in mine.values())  # the step ran as simulated


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: f"{s.kind}-p{s.num_ranks}-m{s.num_microbatches}")
def test_the_wait_before_a_pair_counts_both_passes_inputs(sched):
    """As simulated: every wait is a dependency, as long as the simulator's gaps between blocks.
    A pair that starts later by d (ending as before) adds d to its rank's idle time: a link wait
    where either of its passes takes an input from another rank, else local."""
    tl = zb.timeline(sched)
    t0 = min(s[0] for s in tl.start)
    exact = measure_idle_time(sched, [_trace(sched)])
    for r, (w, starts, ends) in enumerate(zip(exact, tl.start, tl.end)):
        pairs = set(sched.pairs(r))
        firsts = [k for k in range(len(starts)) if k - 1 not in pairs]  # each block's first action
        gaps = starts[0] - t0 + sum(starts[k] - ends[j] for j, k in zip(firsts, firsts[1:]))
        assert w.idle_ms == pytest.approx(gaps, abs=1e-6) and w.dependency_ms == pytest.approx(gaps, abs=1e-6)
        assert w.link_ms == pytest.approx(0, abs=1e-6) and w.local_ms == pytest.approx(0, abs=1e-6)
    for r in range(sched.num_ranks):
        i = sched.pairs(r)[-1]
        f, b = sched.rank_actions[r][i], sched.rank_actions[r][i + 1]
        d = 0.25 * (tl.end[r][i] - tl.start[r][i])
        trace = _trace(sched)
        for ev in trace.traceEvents:
            if ev.pid == r and ev.action in (f, b):
                ev.ts += d * 1e3
                ev.dur -= d * 1e3
        late = measure_idle_time(sched, [trace])
        remote = any(remote_input(a, sched.stage_to_rank) is not None for a in (f, b))
        for q, (a, got) in enumerate(zip(exact, late)):
            held = d if q == r else 0.0
            assert got.idle_ms == pytest.approx(a.idle_ms + held, abs=1e-6)
            assert got.link_ms == pytest.approx(held if remote else 0.0, abs=1e-6)
            assert got.local_ms == pytest.approx(0.0 if remote else held, abs=1e-6)


def test_simulate_measured_reports_the_pairs(capsys, tmp_path):
    sched = SCHEDULES[1]
    zb.save_schedule(sched, tmp_path / "s.json")
    save_trace(_trace(sched), tmp_path / "t.json")
    code, text, err = run_main(capsys, "simulate", tmp_path / "s.json", "--measured", tmp_path / "t.json", "--json")
    assert code == 0, err
    rows = json.loads(text)["passes"]
    pairs = [r for r in rows if r["op"].startswith("F+")]
    assert sum(r["count"] for r in pairs) == sched.num_pairs
    assert all(r["ratio"] == pytest.approx(1.0) for r in rows)
    code, text, err = run_main(capsys, "simulate", tmp_path / "s.json", "--measured", tmp_path / "t.json")
    assert code == 0 and "F+B" in text, err
