import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.helpers import make_profile
from zbsearch import Profile, ZbError, build_classic, load_profile, load_schedule, resolve_profile, save_schedule
from zbsearch.actions import Action, Op, parse_action
from zbsearch.formats.edit import updated


def test_action_notation_round_trips():
    for text, want in [("2F0", Action(2, Op.F, 0)), ("0BW13", Action(0, Op.BW, 13)), ("11W7", Action(11, Op.W, 7))]:
        assert parse_action(text) == want
        assert str(want) == text


@pytest.mark.parametrize("bad", ["F0", "2X0", "2F", "-1F0", "2 F 0", "", "2FF0"])
def test_bad_actions_rejected(bad):
    with pytest.raises(ZbError):
        parse_action(bad)


def _profile_doc(**over):
    doc = {
        "format": "zbsearch.profile", "version": 1, "name": "x", "time_unit": "ms", "memory_unit": "activations",
        "stages": [{"t_f": 1, "t_b": 1, "t_w": 1, "m_f": 1, "m_b": -0.6, "m_w": -0.4}] * 2,
        "t_comm": 0.1, "memory_capacity": None,
    }
    doc.update(over)
    return doc


def _write(tmp_path, doc, name="f.json"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def test_profile_loads_and_keeps_extra_fields(tmp_path):
    prof = load_profile(_write(tmp_path, _profile_doc(device="cpu")))
    assert prof.num_stages == 2 and prof.comm(0) == 0.1
    assert prof.model_dump()["device"] == "cpu"


@pytest.mark.parametrize(
    "over, words",
    [
        ({"format": "zbsearch.schedule"}, "format"),
        ({"version": 2}, "version 2"),
        ({"stages": [{"t_f": -1, "t_b": 1, "t_w": 1, "m_f": 1, "m_b": -0.6, "m_w": -0.4}]}, "t_f"),
        ({"stages": [{"t_f": 1, "t_b": 1, "t_w": 1, "m_f": 1, "m_b": -0.1, "m_w": -0.1}]}, "balance"),
        ({"t_comm": [0.1, 0.2, 0.3]}, "boundaries"),
        ({"stages": []}, "stages"),
        ({"memory_unit": "parsecs"}, "memory_unit"),
        ({"stages": [{"t_f": 1, "t_b": 1, "t_w": 1, "m_f": 1, "m_b": -0.6, "m_w": -0.4},
                     {"t_f": 1, "t_b": 1, "t_w": 1, "m_f": 1, "m_b": -0.6, "m_w": -0.4, "deferred_first": True}]},
         "deferred_first is set on stage 1"),
    ],
)
def test_profile_errors_are_one_line(tmp_path, over, words):
    with pytest.raises(ZbError) as e:
        load_profile(_write(tmp_path, _profile_doc(**over)))
    msg = str(e.value)
    assert "\n" not in msg and words in msg


def test_file_errors(tmp_path):
    with pytest.raises(ZbError, match="no such file"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ZbError, match="not valid JSON"):
        load_profile(_write(tmp_path, "{not json"))
    with pytest.raises(ZbError, match="no bundled profile"):
        resolve_profile("no-such-profile")


def test_bundled_paper_profiles_load():
    prof = resolve_profile("1.5b-m24")
    assert prof.num_stages == 8
    # M_W / M_B = 32h / (34h + 5as) with h=2304, a=24, s=1024 (REFERENCE section 5: 0.366)
    assert -prof.stages[0].m_w == pytest.approx(0.366, abs=5e-4)


def test_bundled_paper_profiles_say_which_selective_mode_they_model():
    """Each bundled paper profile is what its generator writes, recomputing the attention cores
    selectively; the generator's MLP mode keeps what the per-layer account (34sbh + 5as^2b:
    attention block 11sbh + 5as^2b, MLP 19sbh, LayerNorms 4sbh) leaves once an MLP's GeLU input
    and output (8sbh each) are dropped, the attention mode what it leaves without the cores' 5as^2b."""
    from zbsearch.formats.profile import BUNDLED_PROFILES
    from zbsearch.profiles.paper.generate import MODELS, SEQ, paper_profile

    files = sorted((BUNDLED_PROFILES / "paper").glob("*.json"))
    assert len(files) == sum(len(runs) for *_, runs in MODELS.values())
    for f in files:
        name, _, m = f.stem.rpartition("-m")
        assert json.loads(f.read_text()) == json.loads(json.dumps(paper_profile(name, int(m))))
        assert resolve_profile(f.stem).selective == "attention"
    for name, (h, a, _, runs) in MODELS.items():
        per_layer = 34 * h + 5 * a * SEQ  # over sb
        for mode, dropped in (("attention", 5 * a * SEQ), ("mlp", 16 * h)):
            prof = Profile.model_validate(paper_profile(name, min(runs), mode))
            assert prof.selective == mode and prof.name.endswith("" if mode == "attention" else "-mlp")
            assert (1 - prof.stages[0].m_fs) * per_layer == pytest.approx(dropped)
    mlp, core = (paper_profile("1.5b", 24, mode)["stages"][0]["t_rs"] for mode in ("mlp", "attention"))
    assert mlp > 5 * core  # the MLP is 2/3 of a layer's matrix FLOPs, the cores under a tenth here
    # files written before the mode was recorded load, their mode not stated
    old = load_schedule(Path(__file__).resolve().parents[2] / "schedules" / "zb-2p-1.5b-m24.json").profile
    assert old.selective is None
    doc = json.loads(files[0].read_text())
    del doc["selective"]
    assert Profile.model_validate(doc).selective is None and Profile.model_validate(doc).stages[0].t_rs is not None
    with pytest.raises(ValidationError, match="selective"):
        Profile.model_validate({**doc, "selective": "ffn"})


def test_schedule_round_trip(tmp_path):
    sched = build_classic("zb-h1", make_profile(3), 6)
    path = tmp_path / "s.json"
    save_schedule(sched, path)
    back = load_schedule(path)
    assert back.actions == sched.actions and back.predicted == sched.predicted
    assert back.rank_actions[0][0] == Action(0, Op.F, 0)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(stage_to_rank=[0, 1]), "stage_to_rank"),
        (lambda d: d.update(num_ranks=4), "holds no stage"),
        (lambda d: d["actions"][0].append("0Q1"), "bad action"),
        (lambda d: d["actions"][0].append("0F99"), "out of range"),
        (lambda d: d["actions"].pop(), "rows"),
    ],
)
def test_schedule_shape_errors(tmp_path, edit, words):
    doc = json.loads(build_classic("1f1b", make_profile(3), 4).model_dump_json())
    edit(doc)
    with pytest.raises(ZbError) as e:
        load_schedule(_write(tmp_path, doc))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cost_model_takes_one_profile_stage_per_stage_or_per_rank():
    from zbsearch import CostModel

    with pytest.raises(ZbError, match="needs 4 \\(one per stage\\) or 2 \\(one per rank\\)"):
        CostModel.from_profile(make_profile(3), [0, 1, 0, 1])  # uneven
    # 8 stages on 2 ranks split evenly from 4, but would put one profile stage on two ranks
    with pytest.raises(ZbError, match="profile has 4 stages"):
        CostModel.from_profile(make_profile(4), [0, 1, 0, 1, 0, 1, 0, 1])
    assert CostModel.from_profile(make_profile(2), [0, 1, 1, 0]).t_f[0] == make_profile(2).stages[0].t_f / 2
    assert CostModel.from_profile(make_profile(4), [0, 1, 1, 0]).t_f[3] == make_profile(4).stages[3].t_f


def test_profile_schema_is_available():
    schema = Profile.model_json_schema()
    assert "stages" in schema["properties"]


def test_files_written_before_the_typed_fields_still_load():
    # committed before the solver section, the predicted bounds and the profiler's fields were typed
    root = Path(__file__).resolve().parents[2]
    solved = load_schedule(root / "schedules" / "zb-2p-1.5b-m24.json")
    assert solved.solver is not None and solved.solver.status == "optimal" and solved.solver.lower_bound > 0
    assert solved.predicted.lower_bound_makespan is not None and solved.predicted.bubble_rate_makespan is not None
    measured = resolve_profile("cpu-gpt-tiny")
    assert measured.links is not None and measured.measured is not None and measured.device
    assert len(measured.measured.stages) == measured.num_stages and measured.measured.stages[0].t_f.median > 0
    assert resolve_profile("1.5b-m24").measured is None  # a paper profile has none
    assert not any(st.deferred_first for st in measured.stages)  # measured before it: a plain first-stage W


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(solver={**d["solver"], "status": "great"}), "status"),
        (lambda d: d["predicted"].update(surprise=1), "surprise"),
        (lambda d: d.update(notes="x"), "notes"),
    ],
)
def test_schedule_sections_are_typed(tmp_path, edit, words):
    doc = json.loads((Path(__file__).resolve().parents[2] / "schedules" / "zb-2p-1.5b-m24.json").read_text())
    edit(doc)
    with pytest.raises(ZbError, match=words):
        load_schedule(_write(tmp_path, doc))


def test_edits_are_validated():
    prof = make_profile(3)
    assert updated(prof, name="y").name == "y" and updated(prof, name="y").stages == prof.stages
    with pytest.raises(ValidationError):
        updated(prof, stages=[])
    with pytest.raises(ValidationError, match="do not balance"):
        updated(prof.stages[0], m_w=5.0)
    sched = build_classic("1f1b", prof, 4)
    with pytest.raises(ValidationError, match="profile has 2 stages"):
        updated(sched, profile=make_profile(2))  # 3 stages cannot run on a 2-stage profile
