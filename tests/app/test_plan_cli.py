"""``zbsearch plan`` end to end on a generated per-layer profile, and its refusals in one line."""

from __future__ import annotations

import json

import pytest

import zbsearch as zb
from tests.helpers import run_main as _run
from tests.helpers.layers import random_layers
from zbsearch.formats.layers import save_layers
from zbsearch.planner import llama_layers

pytestmark = pytest.mark.slow  # the solver runs


@pytest.fixture
def layers(tmp_path):
    path = tmp_path / "layers.json"
    save_layers(random_layers(7, 6, head=5.0), path)
    return path


def test_plan_writes_a_schedule_every_command_takes(layers, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, text, _ = _run(capsys, "plan", "-l", layers, "-r", "2", "-m", "4", "--memory", "1GiB", "-t", "3", "-o", out)
    assert code == 0
    assert "baselines, solved at the same budget" in text and "bound over every cut" in text
    sched = zb.load_schedule(out)
    part = sched.partition
    assert part is not None and sum(part.units_per_stage) == 8 and part.value == pytest.approx(max(sched.predicted.span))
    assert part.lower_bound <= part.value
    assert _run(capsys, "validate", out)[0] == 0
    assert _run(capsys, "simulate", out)[0] == 0
    code, text, _ = _run(capsys, "export", out, "--to", "torchtitan", "-o", tmp_path / "tt")
    assert code == 0 and "--parallelism.module_fqns_per_model_part tok_embeddings," in text
    assert (tmp_path / "tt" / "schedule.csv").read_text().count("\n") == 2
    code, text, _ = _run(capsys, "plan", "-l", layers, "-r", "2", "-m", "4", "-t", "2", "--json", "--placement", "one")
    assert code == 0 and json.loads(text)["placement"] == "one"


def test_a_partition_that_drops_a_unit_does_not_load(layers, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _run(capsys, "plan", "-l", layers, "-r", "2", "-m", "4", "-t", "2", "--placement", "one", "-o", out)[0] == 0
    doc = json.loads(out.read_text())
    stages = doc["partition"]["stages"]
    widest = max(range(len(stages)), key=lambda s: len(stages[s]))
    stages[widest] = stages[widest][1:]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    code, _, err = _run(capsys, "validate", bad)
    assert code == 1 and err.count("\n") == 1
    assert "the cut is not the model's units in order: unit" in err and "is dropped" in err


@pytest.mark.parametrize("args, words", [
    (["--memory", "lots"], "cannot read the byte budget 'lots'"),
    (["--memory", "1KiB"], "no cut fits a budget of"),
    (["--placement", "w"], "placement 'w': use one, v or auto"),
    (["-r", "1"], "a pipeline needs at least 2 ranks"),
    (["-r", "5"], "8 units cannot fill the 10 pieces"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--recompute", "full"], "--recompute full: per-layer profile 'random-7' has no full recomputation costs"),
    (["--recompute", "some"], "recompute must be one of none, auto, full, not 'some'"),
])
def test_bad_plans_are_one_line_and_write_nothing(layers, tmp_path, capsys, args, words):
    base = {"-r": "2", "--memory": "none", "--placement": "auto", "--optimizer": "adamw", "--recompute": "none"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    if base["-r"] == "5":
        base["--placement"] = "v"
    out = tmp_path / "out.json"
    flat = [x for kv in base.items() for x in kv]
    code, _, err = _run(capsys, "plan", "-l", layers, "-m", "4", "-t", "1", "-o", out, *flat)
    assert code == 1 and err.count("\n") == 1 and words in err, err
    assert not out.exists()


def test_shard_without_the_data_parallel_ranks_is_one_line(layers, tmp_path, capsys):
    out = tmp_path / "out.json"
    code, _, err = _run(capsys, "plan", "-l", layers, "-r", "2", "-m", "4", "-t", "1", "--shard", "-o", out)
    assert code == 1 and err.count("\n") == 1 and "--shard needs --dp and --dp-bandwidth" in err, err
    assert not out.exists()


def test_missing_layers_file_and_a_schedule_without_a_plan(tmp_path, capsys):
    code, _, err = _run(capsys, "plan", "-l", tmp_path / "none.json", "-r", "2", "-m", "4")
    assert code == 1 and "no such file" in err
    sched = tmp_path / "s.json"
    zb.save_schedule(zb.build_classic("1f1b", zb.load_profile("unit-p4"), 4), sched)
    code, _, err = _run(capsys, "export", sched, "--to", "torchtitan", "-o", tmp_path / "tt")
    assert code == 1 and "has no partition section" in err and not (tmp_path / "tt" / "args.txt").exists()


def test_analytic_heads_cost_their_flop_ratio():
    # the head's matrix product against a layer's: 2bshV against 2bs * layer parameters (+ attention)
    L = llama_layers(2, 4096, 256000, heads=32, kv_heads=8, ffn=14336, seq=1, microbatch_size=1)
    layer, head = L.units[1], L.units[-1]
    params = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert head.t_w / layer.t_w == pytest.approx(4096 * 256000 / params)
    assert layer.params == params and head.params == 4096 + 4096 * 256000


def test_plan_with_recomputation_writes_a_schedule_the_runtime_path_takes(tmp_path, capsys):
    from zbsearch.actions import Op

    L = random_layers(8, 6, head=4.0, recompute="full")
    path = tmp_path / "layers.json"
    save_layers(L, path)
    out = tmp_path / "plan.json"
    # a budget that holds about one microbatch in flight per rank: without recomputation, fewer cuts fit
    code, text, _ = _run(capsys, "plan", "-l", path, "-r", "2", "-m", "4", "--memory", "12MiB", "-t", "3",
                         "--placement", "one", "--recompute", "full", "-o", out)
    assert code == 0, text
    assert "recompute full: 8 forwards checkpointed and recomputed" in text
    assert "baselines, solved at the same budget, recompute full" in text
    sched = zb.load_schedule(out)
    assert sched.partition is not None and sched.partition.recompute == "full"
    assert sum(a.op is Op.R for row in sched.rank_actions for a in row) == 2 * 4
    assert all(st.recompute() is not None for st in sched.profile.stages)  # the costs travel with the plan
    assert _run(capsys, "validate", out)[0] == 0
    assert _run(capsys, "simulate", out)[0] == 0
    # torch's schedules have no recompute action: the export says so in one line
    code, _, err = _run(capsys, "export", out, "--to", "torchtitan", "-o", tmp_path / "tt")
    assert code == 1 and err.count("\n") == 1 and "no recompute action" in err
    # without --recompute the plan recomputes nothing
    code, text, _ = _run(capsys, "plan", "-l", path, "-r", "2", "-m", "4", "--memory", "12MiB", "-t", "3",
                         "--placement", "one", "--json")
    assert code == 0 and json.loads(text)["recompute"] == "none"
