"""Recomputation as a pass: notation, profile fields, costs, simulator, validator, export.

A schedule recomputes microbatch j on stage s by holding R(s, j) (full) or RS(s, j) (selective):
its F then runs checkpointed (keeps ``m_fc``, costs ``t_fc``) and the recompute pass, before the
backward on the same rank, rebuilds the rest (allocates m_f - m_fc, costs ``t_r``). Each claim
here is checked against a hand count of the same schedule, not against the code's own sums.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

import zbsearch as zb
from zbsearch.actions import Action, Op, parse_action
from zbsearch.formats.profile import Profile, StageCost
from zbsearch.formats.torch_csv import to_torch_csv
from zbsearch.render.gantt import OP_NAMES, colour, op_char, schedule_panel


def _profile(selective: bool = False) -> Profile:
    extra = {"t_fc": 1.25, "t_r": 0.75, "m_fc": 0.125}
    if selective:
        extra.update({"t_rs": 0.25, "m_fs": 0.5})
    st = StageCost(t_f=1.0, t_b=1.0, t_w=0.5, m_f=1.0, m_b=-0.25, m_w=-0.75, **extra)
    return Profile(name="rc", memory_unit="activations", stages=[st, st], t_comm=0.0)


def _rows(text: list[list[str]]) -> list[list[Action]]:
    return [[parse_action(a) for a in row] for row in text]


# one recomputed microbatch (0 on stage 0) next to a plain one (1), on two ranks
_TWO = [["0F0", "0F1", "0R0", "0B0", "0W0", "0B1", "0W1"], ["1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]]


def test_notation_round_trips():
    for text, op in (("2R3", Op.R), ("0RS11", Op.RS), ("4BW0", Op.BW)):
        a = parse_action(text)
        assert a.op is op and str(a) == text
    with pytest.raises(zb.ZbError, match="R|RS"):
        parse_action("0X1")


def test_old_profiles_load_and_offer_no_recomputation():
    prof = zb.load_profile("cpu-gpt-tiny")
    assert not zb.CostModel.from_profile(prof, list(range(prof.num_ranks))).can_recompute


@pytest.mark.parametrize("fields,message", [
    ({"t_r": 1.0}, "needs both t_r and m_fc"),
    ({"m_fs": 0.5}, "needs both t_rs and m_fs"),
    ({"t_fc": 1.0}, "without t_r and m_fc"),
    ({"t_r": 1.0, "m_fc": 2.0}, "more than m_f"),
])
def test_profile_refuses_incomplete_or_impossible_recomputation(fields, message):
    with pytest.raises(ValidationError, match=message):
        StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5, **fields)


def test_cost_model_prices_checkpointed_forwards_and_recompute_passes():
    cost = zb.CostModel.from_profile(_profile(), [0, 1])
    rows = _rows(_TWO)
    assert cost.durations(rows)[0] == [1.25, 1.0, 0.75, 1.0, 0.5, 1.0, 0.5]  # 0F0 checkpointed, 0F1 not
    assert cost.memory_deltas(rows)[0] == [0.125, 1.0, 0.875, -0.25, -0.75, -0.25, -0.75]


def test_simulator_times_and_counts_memory_as_by_hand():
    cost = zb.CostModel.from_profile(_profile(), [0, 1])
    tl = zb.simulate(_rows(_TWO), cost)
    # rank 0: F0 [0, 1.25], F1 [1.25, 2.25], R0 [2.25, 3], B0 waits for 1B0: 1F0 [1.25, 2.25],
    # 1B0 [2.25, 3.25], so B0 [3.25, 4.25], W0 [4.25, 4.75], B1 waits for 1B1 [4.25, 5.25]
    assert tl.start[0] == pytest.approx([0.0, 1.25, 2.25, 3.25, 4.25, 5.25, 6.25])
    assert tl.memory[0] == pytest.approx([0.125, 1.125, 2.0, 1.75, 1.0, 0.75, 0.0])
    assert tl.busy[0] == pytest.approx(1.25 + 1.0 + 1.0 + 0.5 + 1.0 + 0.5)  # the recompute pass is not busy time
    assert zb.find_problem(zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows(_TWO), memory_limit=[2.0, 2.0])) is None
    over = zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows(_TWO), memory_limit=[1.5, 2.0])
    assert zb.find_problem(over) == "rank 0: memory reaches 2 after 0R0 (position 2), over its limit 1.5"


@pytest.mark.parametrize("rank0,message", [
    (["0F0", "0F1", "0B0", "0R0", "0W0", "0B1", "0W1"], "0R0 at position 3 comes after 0B0 at position 2"),
    (["0R0", "0F0", "0F1", "0B0", "0W0", "0B1", "0W1"], "0R0 at position 0 comes before 0F0 at position 1"),
    (["0F0", "0F1", "0R0", "0R0", "0B0", "0W0", "0B1", "0W1"], "0F0 is recomputed twice"),
    (["0F0", "0F1", "0RS0", "0B0", "0W0", "0B1", "0W1"], "offers no selective recomputation (t_rs, m_fs) on stage 0"),
])
def test_validator_names_the_bad_recompute_pass(rank0, message):
    sched = zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows([rank0, _TWO[1]]))
    assert message in zb.find_problem(sched)


def test_recompute_pass_on_a_rank_without_its_stage_is_a_placement_error():
    rows = _rows([_TWO[0], ["1F0", "0R1", "1B0", "1F1", "1B1", "1W0", "1W1"]])
    assert zb.find_problem(zb.Schedule.build("rc", _profile(), 2, [0, 1], rows)) == \
        "0R1 is on rank 1 (position 1) but stage 0 lives on rank 0"


def test_a_profile_without_recomputation_cannot_check_a_recomputing_schedule():
    plain = zb.load_profile("unit-p4")
    sched = zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows(_TWO))
    problem = zb.find_problem(sched, profile=plain.model_copy(update={"stages": plain.stages[:2], "t_comm": 0.0}))
    assert "offers no full recomputation (t_r, m_fc) on stage 0" in problem


def test_selective_recomputation_keeps_and_costs_its_own():
    cost = zb.CostModel.from_profile(_profile(selective=True), [0, 1])
    rows = _rows([["0F0", "0F1", "0RS0", "0B0", "0W0", "0B1", "0W1"], _TWO[1]])
    assert cost.durations(rows)[0][:3] == [1.0, 1.0, 0.25]  # t_fs absent: the checkpointed F costs t_f
    assert cost.memory_deltas(rows)[0][:3] == [0.5, 1.0, 0.5]


def test_virtual_stages_keep_the_stage_input_and_split_the_rest():
    """A profile stage cut in two: times halve; a full checkpoint keeps the input of each piece
    (not half of it), a selective one half of what it kept."""
    prof = _profile(selective=True)
    cost = zb.CostModel.from_profile(prof, zb.placement(2, 2, "v"))
    full, sel = cost.offer(1, Op.R), cost.offer(1, Op.RS)
    assert (full.t_f, full.t_r, full.keep) == (0.625, 0.375, 0.125)
    assert (sel.t_r, sel.keep) == (0.125, 0.25)


def test_torch_csv_refuses_recomputation():
    sched = zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows(_TWO))
    with pytest.raises(zb.ZbError, match="no recompute action, and this schedule recomputes 1 forwards"):
        to_torch_csv(sched)


def test_gantt_draws_recompute_passes_in_their_own_colour():
    sched = zb.with_prediction(zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows(_TWO)))
    panel = schedule_panel(sched)
    bars = {str(b.action): b for row in panel.rows for b in row}
    assert bars["0R0"].end - bars["0R0"].start == pytest.approx(0.75)
    assert colour(Op.R, 0) not in {colour(op, 0) for op in (Op.F, Op.B, Op.W, Op.BW)}
    assert op_char(Op.R, 0) == "R" and OP_NAMES[Op.RS] == "selective recompute"
    # the bubble counts recomputation with the idle time, as the simulator does
    assert panel.bubble_rate == pytest.approx(1 - max(zb.timeline(sched).busy) / panel.span)


def test_schedule_file_round_trips_recompute_passes(tmp_path):
    sched = zb.Schedule.build("rc", _profile(), 2, [0, 1], _rows(_TWO))
    path = tmp_path / "s.json"
    zb.save_schedule(sched, path)
    assert json.loads(path.read_text())["actions"][0][2] == "0R0"
    assert zb.load_schedule(path).rank_actions == sched.rank_actions
