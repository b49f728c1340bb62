"""Overlapped pairs (a forward and another microbatch's backward run together on one rank):
the profile fields, the cost rule, the schedule's ``overlapped`` and compact text, and the
simulator and validator against a small reference written here from the rule alone."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tests.helpers import make_profile
from tests.helpers.reference import needs, positions, random_order, random_profile
from zbsearch import CostModel, Profile, StageCost, build_classic, solve
from zbsearch.actions import Action, Op, parse_row, row_text
from zbsearch.errors import ZbError
from zbsearch.formats.fileio import parse_model
from zbsearch.formats.schedule import Schedule, load_schedule, save_schedule
from zbsearch.layout import placement
from zbsearch.simulator import Deadlock, simulate
from zbsearch.validator import find_problem

# ---- generators ------------------------------------------------------------------------------

def moe_profile(rng: random.Random, p: int) -> Profile:
    """``random_profile`` with all-to-all inside F and the backward: a share of the least time
    of each pass that holds it (0 now and then: stages without experts), and now and then a
    share of what pairs hide that stays exposed (``pair_exposed``)."""
    base = random_profile(rng, p)
    stages = []
    for st in base.stages:
        share = rng.choice([0.0, 0.2, 0.4, round(rng.uniform(0, 0.9), 3)])
        a_f = share * min(st.t_f, st.fused_forward)
        a_b = rng.choice([share, round(rng.uniform(0, 0.9), 3)]) * min(st.t_b, st.fused_backward)
        exposed = rng.choice([None, None, 0.0, 1.0, round(rng.random(), 3)])
        stages.append(StageCost(**{**st.model_dump(), "a_f": a_f, "a_b": a_b, "pair_exposed": exposed}))
    return base.model_copy(update={"stages": stages})


def pair_up(rng: random.Random, rows: list[list[Action]], moves: bool) -> tuple[list[list[Action]], list[list[int]]]:
    """Random pairs of a forward and the backward after it; with ``moves``, some backwards are
    first moved to just after a forward (which may deadlock, or pair passes that depend on each
    other: both simulators must then agree on the failure)."""
    rows = [list(r) for r in rows]
    if moves:
        for row in rows:
            for _ in range(rng.randint(0, 2)):
                fs = [i for i, a in enumerate(row) if a.op is Op.F]
                if not fs:
                    break
                i = rng.choice(fs)
                later = [k for k in range(i + 2, len(row)) if row[k].op in (Op.B, Op.BW)]
                if later:
                    row.insert(i + 1, row.pop(rng.choice(later)))
    pairs = []
    for row in rows:
        at, i = [], 0
        while i < len(row) - 1:
            own = row[i].mb == row[i + 1].mb  # a pair that waits for itself: now and then
            if row[i].op is Op.F and row[i + 1].op in (Op.B, Op.BW) and rng.random() < (0.05 if own else 0.8):
                at.append(i)
                i += 2
            else:
                i += 1
        pairs.append(at)
    return rows, pairs


def case(seed: int, moves: bool = False):
    rng = random.Random(seed)
    p = rng.randint(1, 4)
    chunks, layout = rng.choice([(1, "looped"), (2, "v"), (2, "looped")])
    cost = CostModel.from_profile(moe_profile(rng, p), placement(p, chunks, layout))
    rows = random_order(rng, cost, rng.randint(1, 5), fuse=rng.choice([0.0, 0.4]))
    rows, pairs = pair_up(rng, rows, moves)
    return cost, rows, pairs


# ---- the reference ---------------------------------------------------------------------------

def ref_time(row: list[Action], a: Action, cost: CostModel) -> float:
    if a.op is Op.F:
        return cost.t_ff[a.stage] if Action(a.stage, Op.BW, a.mb) in row else cost.t_f[a.stage]
    return {Op.B: cost.t_b, Op.W: cost.t_w, Op.BW: cost.t_bw}[a.op][a.stage]


def ref_comm(cost: CostModel, a: Action) -> float:
    """The all-to-all inside a pass, read off the cost model's fields."""
    if not cost.a_f:
        return 0.0
    return cost.a_f[a.stage] if a.op is Op.F else cost.a_b[a.stage] if a.op in (Op.B, Op.BW) else 0.0


def ref_exposed(cost: CostModel, a: Action) -> float:
    return cost.exposed[a.stage] if cost.exposed else 0.0


def ref_pair(row, f: Action, b: Action, cost: CostModel) -> float:
    """The design's rule: the two computes plus the all-to-all neither hides, and of what each
    pass's all-to-all hides, its stage's exposed share."""
    t_f, t_b, a_f, a_b = ref_time(row, f, cost), ref_time(row, b, cost), ref_comm(cost, f), ref_comm(cost, b)
    hid_f, hid_b = min(a_f, t_b - a_b), min(a_b, t_f - a_f)
    return t_f + t_b - hid_f - hid_b + ref_exposed(cost, f) * hid_f + ref_exposed(cost, b) * hid_b


def reference(rows: list[list[Action]], cost: CostModel, pairs: list[list[int]]):
    """(start, end, memory, busy) by round-robin sweeps over blocks (an action, or a pair that
    starts once the inputs of both of its passes have arrived), or Deadlock with the waits."""
    S = cost.num_stages
    where = positions(rows)
    blocks = [[[i, i + 1] if i in pairs[r] else [i] for i in range(len(row)) if i - 1 not in pairs[r]]
              for r, row in enumerate(rows)]
    start = [[None] * len(row) for row in rows]
    end = [[None] * len(row) for row in rows]
    busy = [0.0] * len(rows)
    nxt = [0] * len(rows)
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(rows):
            while nxt[r] < len(blocks[r]):
                block = blocks[r][nxt[r]]
                deps = [(d, row[k]) for k in block for d in needs(row[k], S)]
                if any(end[where[d][0]][where[d][1]] is None for d, _ in deps):
                    break
                t = end[r][block[0] - 1] if block[0] else 0.0
                for d, a in deps:
                    q, i = where[d]
                    t = max(t, end[q][i] + (cost.comm(d[0], a.stage) if d[0] != a.stage else 0.0))
                took = ref_time(row, row[block[0]], cost) if len(block) == 1 else ref_pair(row, *(row[k] for k in block), cost)
                for k in block:
                    start[r][k], end[r][k] = t, t + took
                busy[r] += took
                nxt[r] += 1
                moved = True
    if any(n < len(b) for n, b in zip(nxt, blocks)):
        waits = []
        for r, row in enumerate(rows):
            if nxt[r] < len(blocks[r]):
                block = blocks[r][nxt[r]]
                d = next(d for k in block for d in needs(row[k], S) if end[where[d][0]][where[d][1]] is None)
                q, i = where[d]
                waits.append((r, row[block[0]], rows[q][i], q))
        raise Deadlock(waits)
    memory = []
    for row in rows:
        cur, trace = 0.0, []
        for a in row:  # a pair: F's allocation, then B's change
            cur += cost.memory(a.stage, a.op)
            trace.append(cur)
        memory.append(trace)
    return start, end, memory, busy


def outcome(fn):
    try:
        got = fn()
    except Deadlock as e:
        return ("deadlock", e.waits)
    if isinstance(got, tuple):
        return ("ok", *got)
    return ("ok", got.start, got.end, got.memory, got.busy)


def close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a))
    return a == b


# ---- the cost rule and the profile ---------------------------------------------------------

@pytest.mark.parametrize("seed", range(200))
def test_pair_time_between_its_bounds(seed):
    rng = random.Random(seed)
    t_f, t_b = rng.uniform(0.1, 5), rng.uniform(0.1, 5)
    a_f, a_b = t_f * rng.choice([0, 1, rng.random()]), t_b * rng.choice([0, 1, rng.random()])
    cost = CostModel.from_profile(make_profile(1), [0])
    cost = replace(cost, a_f=(a_f,), a_b=(a_b,))
    f, b = Action(0, Op.F, 1), Action(0, Op.B, 0)
    got = cost.pair_time(f, b, t_f, t_b)
    # never less than either pass, nor than the two computes; never more than the two passes
    assert max(t_f, t_b, (t_f - a_f) + (t_b - a_b)) - 1e-12 <= got <= t_f + t_b + 1e-12
    # nothing to hide: the sum; all communication: the longer hides the shorter
    if a_f == 0 == a_b:
        assert got == t_f + t_b
    if a_f == t_f and a_b == t_b:
        assert abs(got - max(t_f, t_b) - min(t_f, t_b)) < 1e-12  # two all-to-alls cannot hide behind each other
    # a share of what is hidden left exposed: the pair moves from the rule's time towards the sum, in proportion
    e = rng.choice([0.0, 1.0, rng.random()])
    exposed = replace(cost, exposed=(e,)).pair_time(f, b, t_f, t_b)
    assert exposed == pytest.approx(got + e * (t_f + t_b - got), abs=1e-12)
    # what bounds take off a pass never exceeds what a pair takes off it
    with_e = replace(cost, exposed=(e,))
    assert with_e.hideable(0, Op.F) == pytest.approx((1 - e) * a_f) and with_e.hideable(0, Op.B) == pytest.approx((1 - e) * a_b)
    assert t_f + t_b - with_e.hideable(0, Op.F) - with_e.hideable(0, Op.B) <= exposed + 1e-12


def test_profile_fields_load_check_and_split():
    old = make_profile(2)
    assert not old.has_all_to_all and old.ep == 1
    assert CostModel.from_profile(old, [0, 1]).a_f == ()
    data = old.model_dump()
    data["stages"][0]["a_f"], data["stages"][0]["a_b"] = 0.4, 0.6
    data["mesh"] = {"pp": 2, "ep": 4}
    prof = Profile.model_validate(data)
    assert prof.has_all_to_all and prof.ep == 4 and prof.mesh.ep == 4
    cost = CostModel.from_profile(prof, placement(2, 2, "v"))  # each profile stage cut in two
    assert cost.a_f == (0.2, 0.2, 0.0, 0.0) and cost.a_b == (0.3, 0.3, 0.0, 0.0)
    assert cost.all_to_all(0, Op.R) == 0.2 and cost.all_to_all(0, Op.W) == 0.0 and cost.all_to_all(1, Op.BW) == 0.3
    assert cost.exposed == () and cost.pair_time(Action(0, Op.F, 1), Action(0, Op.B, 0), 1.0, 1.0) == pytest.approx(1.5)
    data["stages"][0]["pair_exposed"] = 0.5
    cost = CostModel.from_profile(Profile.model_validate(data), placement(2, 2, "v"))
    assert cost.exposed == (0.5, 0.5, 0.0, 0.0)  # the share, not split
    assert cost.pair_time(Action(0, Op.F, 1), Action(0, Op.B, 0), 1.0, 1.0) == pytest.approx(1.75)  # 2 - 0.5 (0.2 + 0.3)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ZbError, match="pair_exposed"):
            parse_model(Profile, {**data, "stages": [{**data["stages"][0], "pair_exposed": bad}, data["stages"][1]]}, "p.json")
    data["stages"][1]["a_b"] = 1.5  # more than t_b = 1
    with pytest.raises(ZbError, match="a_b = 1.5 is more than t_b"):
        parse_model(Profile, data, "p.json")


# ---- the schedule's pairs and the compact text ---------------------------------------------

def _sched(rows, pairs, p=None, m=None):
    prof = make_profile(p or len(rows))
    m = m or 1 + max(a.mb for row in rows for a in row)
    return Schedule.build("hand", prof, m, list(range(len(rows))), rows, overlapped=pairs)


def test_compact_text_round_trips_and_files_keep_pairs(tmp_path):
    for seed in range(30):
        _, rows, pairs = case(seed)
        for row, at in zip(rows, pairs):
            assert parse_row(row_text(row, at)) == (row, at)
    rows = [[parse_row([t])[0][0] for t in r] for r in (["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],)]
    text = row_text(rows[0], [3])
    assert text == ["0F0", "0F1", "0B0", "0F2+0B1", "0B2"]
    s = _sched(rows, [[3]])
    save_schedule(s, tmp_path / "s.json")
    back = load_schedule(tmp_path / "s.json")
    assert back.overlapped == [[3]] and back.compact() == [text]
    data = json.loads((tmp_path / "s.json").read_text())
    data["actions"], data["overlapped"] = [text], None  # pairs written in the compact text
    assert Schedule.model_validate(data).overlapped == [[3]]
    data.pop("overlapped")
    assert Schedule.model_validate(data).actions == s.actions
    del data["actions"]
    data["actions"] = s.actions  # a file without pairs: none
    assert Schedule.model_validate(data).overlapped is None


@pytest.mark.parametrize("pairs,message", [
    ([[2]], "is not a forward followed by a backward"),        # 0B0+0F2
    ([[1, 2]], "overlaps the pair before it"),
    ([[3, 3]], "is listed twice"),
    ([[3, 1]], "is out of order"),
    ([[5]], "a pair needs positions 5 and 6"),
    ([[3], []], "overlapped has 2 rows for 1 ranks"),
])
def test_bad_pairs_are_one_line(tmp_path, pairs, message):
    s = _sched([[Action(0, Op.F, 0), Action(0, Op.F, 1), Action(0, Op.B, 0), Action(0, Op.F, 2), Action(0, Op.B, 1),
                 Action(0, Op.B, 2)]], None)
    data = s.model_dump()
    data["overlapped"] = pairs
    with pytest.raises(ZbError, match=message) as e:
        parse_model(Schedule, data, "s.json")
    assert "\n" not in str(e.value)
    data["actions"] = [["0F0", "0F1+0B0+0B1"]]
    data["overlapped"] = None
    with pytest.raises(ZbError, match="bad pair"):
        parse_model(Schedule, data, "s.json")


# ---- the simulator and the validator against the reference ---------------------------------

@pytest.mark.parametrize("seed", range(300))
def test_simulator_same_as_reference(seed):
    cost, rows, pairs = case(seed, moves=seed % 2 == 1)
    want = outcome(lambda: reference(rows, cost, pairs))
    got = outcome(lambda: simulate(rows, cost, pairs))
    assert close(got, want), (got, want)


def test_pairs_shorten_and_depend_on_all_to_all():
    """A pair hides what the rule says; without all-to-all it is the two passes back to back."""
    prof = make_profile(1, t_f=2.0, t_b=3.0)
    rows = [[Action(0, Op.F, 0), Action(0, Op.F, 1), Action(0, Op.B, 0), Action(0, Op.W, 0), Action(0, Op.B, 1),
             Action(0, Op.W, 1)]]
    plain = CostModel.from_profile(prof, [0])
    paired, alone = simulate(rows, plain, [[1]]), simulate(rows, plain)
    assert paired.end[0][2:] == alone.end[0][2:] and paired.end[0][1] == alone.end[0][2]  # the pair ends with its B
    data = prof.model_dump()
    data["stages"][0].update(a_f=0.5, a_b=1.0)
    moe = CostModel.from_profile(Profile.model_validate(data), [0])
    tl = simulate(rows, moe, [[1]])
    # 1F1 with 0B0: 2 + 3 - min(0.5, 2) - min(1, 1.5) = 3.5, from t = 2
    assert tl.start[0][1] == tl.start[0][2] == 2.0 and tl.end[0][1] == tl.end[0][2] == 5.5
    assert tl.busy[0] == pytest.approx(max(tl.span) - 0.0) and tl.overlapped == [[1]]
    assert tl.memory == simulate(rows, moe).memory  # F's allocation, then B's change


@pytest.mark.parametrize("seed", range(200))
def test_validator_names_dependent_pairs_and_accepts_the_rest(seed):
    cost, rows, pairs = case(seed, moves=True)
    m = 1 + max(a.mb for row in rows for a in row)
    prof = Profile(name="x", memory_unit="activations", stages=[StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)])
    S = cost.num_stages
    try:
        sched = Schedule.build("gen", prof.model_copy(update={"stages": prof.stages * S}), m, list(cost.stage_to_rank),
                               rows, overlapped=pairs)
    except ValueError:
        return  # a profile of S stages does not fit this placement (ranks fewer than S and not one per rank)
    problem = find_problem(sched)
    dependent = [(r, i) for r, at in enumerate(pairs) for i in at if rows[r][i].mb == rows[r][i + 1].mb]
    try:
        reference(rows, sched_cost(sched), pairs)
        runs = True
    except Deadlock:
        runs = False
    if dependent:
        r, i = dependent[0]
        assert problem is not None and "depends on" in problem and f"rank {r}:" in problem
    elif runs:
        assert problem is None
    else:
        assert problem is not None and ("deadlock" in problem or "comes before" in problem)


def sched_cost(sched: Schedule) -> CostModel:
    return CostModel.from_profile(sched.profile, sched.stage_to_rank)


def test_dependent_pair_message():
    rows = [[Action(0, Op.F, 0), Action(0, Op.B, 0), Action(0, Op.W, 0)]]
    s = _sched(rows, [[0]])
    assert find_problem(s) == ("rank 0: the overlapped pair 0F0+0B0 at position 0 pairs 0B0 with 0F0, which it depends on: "
                               "a pair's passes must not depend on each other")


def test_a_pair_is_one_bar_in_every_chart(tmp_path):
    from zbsearch import render

    rows = [parse_row(["0F0", "0F1", "0B0", "0W0", "0F2+0B1", "0W1", "0B2", "0W2"])]
    s = _sched([rows[0][0]], [rows[0][1]])
    panel = render.schedule_panel(s)
    bars = panel.rows[0]
    assert [b.text for b in bars] == s.compact()[0]  # one bar per compact action
    pair = bars[4]
    assert pair.actions == (Action(0, Op.F, 2), Action(0, Op.B, 1)) and pair.label == "2+1"
    tl = simulate(s.rank_actions, sched_cost(s), s.overlapped)
    assert (pair.start, pair.end) == (tl.start[0][4], tl.end[0][5])
    text = render.render_text([panel], 80)
    assert "O overlapped forward and backward" in text and "O2+1" in text.splitlines()[1]
    html = render.write_chart([panel], tmp_path / "g.html")
    assert "0F2+0B1 (overlapped forward and backward)" in html.read_text()


def moe_unit(p: int, share: float = 0.3) -> Profile:
    data = make_profile(p).model_dump()
    for st in data["stages"]:
        st.update(a_f=share * st["t_f"], a_b=share * st["t_b"])
    return Profile.model_validate(data)


def test_compare_shows_dualpipe_v_with_and_without_overlap():
    from zbsearch import build_classic
    from zbsearch.compare import compare

    rows = {r["kind"]: r for r in compare(moe_unit(4), 12, time_limit=1.0) if "span" in r}
    serial = build_classic("dualpipe-v", moe_unit(4), 12, overlap=False)
    assert serial.overlapped is None and rows["dualpipe-v (no overlap)"]["span"] == max(serial.predicted.span)
    assert rows["dualpipe-v"]["span"] < rows["dualpipe-v (no overlap)"]["span"]
    assert "dualpipe-v (no overlap)" not in {r["kind"] for r in compare(make_profile(4), 12, time_limit=1.0)}


def test_however_short_the_time_a_solve_is_never_slower_than_dualpipe_v():
    """Where the passes hold all-to-all, DualPipeV is built and timed whatever time is left."""
    st = StageCost(t_f=2.0, t_b=2.0, t_w=1.6, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=0.8, a_b=0.8)
    prof = Profile(name="moe-p8", memory_unit="activations", stages=[st] * 8, t_comm=0.05)
    dpv = build_classic("dualpipe-v", prof, 32)
    res = solve(prof, 32, list(dpv.predicted.peak_memory), chunks=2, time_limit=0.01)
    assert "dualpipe-v" in res.info.classic and "dualpipe-v" not in res.info.classic_not_built
    assert res.info.value <= max(dpv.predicted.span) * (1 + 1e-9)
