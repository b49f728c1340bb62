"""The profile's mesh section: what it records, that it travels with schedules, that older files
load as one pipeline at tensor-parallel degree 1, and that it must agree with the profile."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

import zbsearch as zb
from tests.helpers import make_profile
from zbsearch.formats.mesh import ProfileMesh, TensorParallelLink
from zbsearch.formats.profile import Quartiles
from zbsearch.reductions import with_measured_reductions, with_reductions


def _tp2(p: int = 4) -> zb.Profile:
    link = TensorParallelLink(group="local", backend="gloo", bytes=2**20,
                              all_reduce_ms=Quartiles(median=0.5, q1=0.4, q3=0.7, mean=0.55))
    return make_profile(p).model_copy(update={"mesh": ProfileMesh(pp=p, tp=2, sequence_parallel=True, tp_link=link)})


def test_the_mesh_round_trips_through_profile_and_schedule_files(tmp_path):
    prof = _tp2()
    zb.save_profile(prof, tmp_path / "p.json")
    back = zb.load_profile(tmp_path / "p.json")
    assert back == prof and back.mesh.tp == 2 and back.mesh.tp_link.all_reduce_ms.q3 == 0.7
    assert json.loads((tmp_path / "p.json").read_text())["mesh"]["version"] == 1
    for sched in (zb.build_classic("zb-h1", back, 8), zb.solve(back, 8, "2p", time_limit=1).schedule):
        zb.save_schedule(sched, tmp_path / "s.json")
        got = zb.load_schedule(tmp_path / "s.json")
        assert got.profile.mesh == prof.mesh and got.profile.made_for.tp == 2


def test_files_without_the_section_are_one_pipeline_at_tp_1_with_their_replicas():
    for name in ("unit-p4", "cpu-gpt-tiny", "1.5b-m24"):
        prof = zb.load_profile(name)
        assert prof.mesh is None
        made = prof.made_for
        assert (made.pp, made.dp_replicate, made.dp_shard, made.tp) == (prof.num_ranks, 1, 1, 1)
    plain = make_profile(4)
    replicated = with_reductions(plain, 8, 10.0, [1e6] * 4)
    assert replicated.mesh is None and replicated.made_for.dp_replicate == 8 and replicated.made_for.dp_shard == 1
    sharded = with_reductions(plain, 4, 10.0, [1e6] * 4, sharded=True)
    assert (sharded.made_for.dp_replicate, sharded.made_for.dp_shard) == (1, 4)
    assert sharded.made_for.describe() == "pp 4 x dp_shard 4"


def test_reductions_carry_their_replicas_into_the_mesh_and_the_file_still_loads(tmp_path):
    spread = [Quartiles(median=1.0, q1=1.0, q3=1.0, mean=1.0)] * 4
    for prof, sizes in ((with_reductions(_tp2(), 2, 10.0, [1e6] * 4), (2, 1)),
                        (with_reductions(_tp2(), 2, 10.0, [1e6] * 4, sharded=True), (1, 2)),
                        (with_measured_reductions(_tp2(), 4, spread, [1e6] * 4, group="local", backend="gloo"), (4, 1))):
        assert (prof.mesh.dp_replicate, prof.mesh.dp_shard, prof.mesh.tp) == (*sizes, 2)
        zb.save_profile(prof, tmp_path / "p.json")
        assert zb.load_profile(tmp_path / "p.json").mesh == prof.mesh
        assert prof.mesh.world == 4 * sizes[0] * sizes[1] * 2


@pytest.mark.parametrize("mesh, why", [
    ({"pp": 3}, "mesh.pp is 3 but the profile's stages are on 4 pipeline ranks"),
    ({"pp": 4, "dp_replicate": 2}, "does not match the data_parallel section's 1 replicated replicas"),
    ({"pp": 4, "tp": 0}, "greater than or equal to 1"),
    ({"pp": 4, "version": 2}, "version"),
])
def test_a_mesh_that_disagrees_with_the_profile_is_refused(mesh, why):
    doc = make_profile(4).model_dump()
    with pytest.raises(ValidationError, match=why):
        zb.Profile.model_validate({**doc, "mesh": mesh})


def test_sharded_replicas_must_be_the_meshes_shards():
    doc = with_reductions(make_profile(4), 2, 10.0, [1e6] * 4, sharded=True).model_dump()
    with pytest.raises(ValidationError, match="2 sharded replicas"):
        zb.Profile.model_validate({**doc, "mesh": {"pp": 4, "dp_replicate": 2}})
    assert zb.Profile.model_validate({**doc, "mesh": {"pp": 4, "dp_shard": 2}}).mesh.dp_shard == 2


def test_the_link_and_the_chart_say_the_mesh():
    from zbsearch.profiler.report import mesh_summary
    from zbsearch.render import render_text, schedule_panel

    prof = _tp2()
    # a ring all-reduce over 2 ranks moves 2(N-1)/N = 1 times the bytes through each rank
    assert prof.mesh.tp_bandwidth_gbs() == pytest.approx(2**20 / 0.5e-3 / 1e9)
    assert prof.mesh.describe() == "pp 4 x tp 2 (sequence parallel)"
    lines = mesh_summary(prof)
    assert lines[0] == "mesh: pp 4 x tp 2 (sequence parallel); times and bytes are one of the 2 tensor-parallel ranks'"
    assert any(line.startswith("  tp link: all-reduce of 1024 KiB") and "0.5 ms median" in line for line in lines)
    title = render_text([schedule_panel(zb.build_classic("1f1b", prof, 4))], 100).splitlines()[0]
    assert title.endswith("mesh pp 4 x tp 2 (sequence parallel)")
    plain = render_text([schedule_panel(zb.build_classic("1f1b", make_profile(4), 4))], 100).splitlines()[0]
    assert "mesh" not in plain


def test_a_top_level_ep_moves_into_the_mesh_and_saves_there(tmp_path):
    """Files written when the expert-parallel degree sat beside the mesh load with it in the mesh."""
    for base in (make_profile(2), with_reductions(make_profile(2), 4, 10.0, [1e6] * 2), _tp2(2)):
        data = json.loads(base.model_dump_json(exclude_none=True))
        data["ep"] = 4
        (tmp_path / "old.json").write_text(json.dumps(data))
        prof = zb.load_profile(tmp_path / "old.json")
        assert prof.ep == prof.mesh.ep == 4 and "ep" not in (prof.model_extra or {})
        assert prof.mesh.model_copy(update={"ep": 1}) == base.made_for  # nothing else in the mesh changes
        zb.save_profile(prof, tmp_path / "new.json")
        saved = json.loads((tmp_path / "new.json").read_text())
        assert "ep" not in saved and saved["mesh"]["ep"] == 4
        assert zb.load_profile(tmp_path / "new.json") == prof
        data["ep"] = 1  # the default: no mesh section made for it
        (tmp_path / "old.json").write_text(json.dumps(data))
        assert zb.load_profile(tmp_path / "old.json").mesh == base.mesh
    assert make_profile(2).ep == 1 and "ep 3" in ProfileMesh(pp=2, ep=3).describe()
    data = json.loads(_tp2(2).model_dump_json())
    data["mesh"]["ep"], data["ep"] = 2, 4
    with pytest.raises(ValidationError, match="disagrees with mesh.ep 2"):
        zb.Profile.model_validate(data)
    for bad in (0, "2", True):
        data = json.loads(make_profile(2).model_dump_json())
        data["ep"] = bad
        with pytest.raises(ValidationError, match="ep must be a whole number"):
            zb.Profile.model_validate(data)
