"""``zbsearch tune`` end to end on generated per-layer profiles, and its refusals in one line."""

from __future__ import annotations

import json

import pytest

import zbsearch as zb
from tests.helpers import run_main as _run
from zbsearch.formats.layers import save_layers
from zbsearch.planner import llama_layers
from zbsearch.tuner import load_tune
from zbsearch.tuner.launch import Launch


def _layers(tmp_path, sizes=(1, 2, 4), recompute=True, model=None):
    paths = []
    for b in sizes:
        prof = llama_layers(4, 256, 2000, heads=4, seq=128, microbatch_size=b, tflops=20.0 + 5 * b, recompute=recompute,
                            name=f"tiny-b{b}")
        if model is not None:
            prof = prof.model_copy(update={"model": {**model, "microbatch_size": b}})
        path = tmp_path / f"tiny-b{b}.json"
        save_layers(prof, path)
        paths += ["-l", path]
    return paths


_BASE = ["-r", "8", "--ranks-per-node", "4", "--memory", "2GiB", "-g", "16", "--optimizer", "mixed", "-t", "8",
         "--plan-time", "0.3", "--memory-gbs", "500"]


def test_tune_writes_the_winner_every_command_takes(tmp_path, capsys):
    gpt = {"model": "builtin gpt", "layers": 4, "hidden": 256, "heads": 4, "seq": 128, "vocab": 2000}
    out = tmp_path / "tuned"
    code, text, err = _run(capsys, "tune", *_layers(tmp_path, model=gpt), *_BASE, "-o", out)
    assert code == 0, err
    assert "fastest first" in text and "the best of each baseline" in text and "speed-up over the best baseline" in text
    res = load_tune(out / "tune.json")
    best = res.winner
    assert best is not None and res.lower_bound_ms <= best.iteration_ms and best.pp * best.dp == 8
    assert f"{best.iteration_ms:.6g}" in text.replace("\n", " ")
    assert _run(capsys, "validate", out / "schedule.json")[0] == 0
    sched = zb.load_schedule(out / "schedule.json")
    assert sched.num_ranks == best.pp and sched.num_microbatches == best.microbatches
    assert max(sched.predicted.iteration) == pytest.approx(best.iteration_ms)
    launch = Launch.model_validate_json((out / "launch.json").read_text())
    assert (launch.pp, launch.dp, launch.microbatch_size) == (best.pp, best.dp, best.microbatch_size)
    run = (out / "run.sh").read_text()
    command = launch.commands[0]
    assert command in run and command.startswith("torchrun --nproc-per-node 4 --nnodes 2 --node-rank")
    assert f"examples/train_gpt.py {out / 'schedule.json'} --dp {best.dp} --tp 1 -b {best.microbatch_size}" in command
    assert "--layers 4 --hidden 256 --heads 4 --seq 128 --vocab 2000" in command
    if sched.partition is not None and best.recomputed == 0:
        args = (out / "torchtitan" / "args.txt").read_text()
        assert f"--parallelism.data_parallel_replicate_degree {best.dp}" in args
    # the same with the stages sharded over the replicas: what runs them is what was costed
    sharded = tmp_path / "sharded"
    code, text, err = _run(capsys, "tune", *_layers(tmp_path, model=gpt), *_BASE, "--shard", "--no-baselines",
                           "--action-ms", "0.05", "-o", sharded)
    assert code == 0 and "host time per action, 0.05 ms" in text, err
    assert zb.load_schedule(sharded / "schedule.json").profile.t_action == 0.05  # the host time per action, priced
    res = load_tune(sharded / "tune.json")
    best, launch = res.winner, Launch.model_validate_json((sharded / "launch.json").read_text())
    assert res.shard and not res.sharded and best is not None
    assert ("--shard" in launch.commands[0].split()) == (best.dp > 1)
    if launch.torchtitan_args is not None:
        assert f"--parallelism.data_parallel_shard_degree {best.dp}" in " ".join(launch.torchtitan_args)
    by_tokens = [x if x != "-g" else "--global-tokens" for x in _BASE]
    by_tokens[by_tokens.index("--global-tokens") + 1] = str(16 * 128)  # the same 16 sequences of 128 tokens
    code, text, _ = _run(capsys, "tune", *_layers(tmp_path), *by_tokens, "--json", "--no-baselines")
    doc = json.loads(text)
    assert code == 0 and doc["format"] == "zbsearch.tune" and all(r["source"] == "tune" for r in doc["rows"])
    assert doc["global_batch"] == 16 and doc["seq"] == 128


def test_tune_prices_the_share_of_a_nodes_link_where_its_pipeline_ranks_reduce(tmp_path, capsys):
    from tests.test_lane_sharing import _reference

    out = tmp_path / "tuned"
    base = [x for x in _BASE]
    base[base.index("-t") + 1] = "4"
    base[base.index("--ranks-per-node") + 1] = "8"  # one node: its pipeline ranks share its link
    code, _, err = _run(capsys, "tune", *_layers(tmp_path, sizes=(1,)), *base, "--dp-share", "1", "--placement", "one",
                        "--no-baselines", "-o", out)
    assert code == 0, err
    res = load_tune(out / "tune.json")
    best, sched = res.winner, zb.load_schedule(out / "schedule.json")
    assert res.cluster.dp_share == 1.0 and best is not None
    # 8 ranks to a node, tp 1: the node holds 8 / dp whole pipeline ranks, which share its link
    per = 8 // best.dp
    sharing = sched.profile.data_parallel.sharing if sched.profile.data_parallel is not None else None
    if per >= 2 and best.pp >= 2:
        assert sharing.share == 1.0 and sharing.ranks_per_link == (per if per < best.pp else None)
    else:
        assert sharing is None
    cost = zb.CostModel.from_profile(sched.profile, sched.stage_to_rank)
    link = [r // min(max(per, 1), best.pp) for r in range(best.pp)]
    want = [f - start[0] for start, _, _, _, f, _ in _reference(sched.rank_actions, cost, link, 1.0)]
    assert max(want) == pytest.approx(best.iteration_ms)


@pytest.mark.parametrize("args, words", [
    (["--tp", "3"], "the tensor-parallel degree 3 does not divide the 8 ranks"),
    (["-g", "7"], "no configuration of 8 ranks (tp 1) takes a global batch of 7"),
    (["--microbatch-sizes", "1,x"], "--microbatch-sizes '1,x': give whole numbers"),
    (["--recompute", "some"], "recompute 'some': search none, auto or full"),
    (["--ranks-per-node", "3"], "cluster: 8 ranks are not whole nodes of 3"),
    (["--placement", "w"], "placement 'w': search one and/or v"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--memory", "lots"], "cannot read the byte budget 'lots'"),
    (["--intra-gbs", "0"], "cluster: intra_node_gbs"),
    (["--global-tokens", "2048"], "give the global batch once"),
    (["--sharded", "--shard"], "not both"),
    (["--dp-share", "-1"], "cluster: dp_share"),
])
def test_bad_tunes_are_one_line_and_write_nothing(tmp_path, capsys, args, words):
    out = tmp_path / "out"
    flat = dict(zip(_BASE[::2], _BASE[1::2]))
    flat.update(zip(args[::2], args[1::2]))
    code, _, err = _run(capsys, "tune", *_layers(tmp_path), *[x for kv in flat.items() for x in kv], "-o", out)
    assert code == 1 and err.count("\n") == 1 and words in err, err
    assert not out.exists()


def test_inputs_that_do_not_belong_together_are_one_line(tmp_path, capsys):
    one = _layers(tmp_path, sizes=(1,))
    code, _, err = _run(capsys, "tune", *one, *one, *_BASE)
    assert code == 1 and "are both at microbatch size 1" in err and err.count("\n") == 1
    code, _, err = _run(capsys, "tune", *_layers(tmp_path, recompute=False), *_BASE, "--recompute", "auto")
    assert code == 1 and "has no recomputation costs" in err
    code, _, err = _run(capsys, "tune", "-l", tmp_path / "none.json", *_BASE)
    assert code == 1 and "no such" in err
    (tmp_path / "file").write_text("")
    code, _, err = _run(capsys, "tune", *one, *_BASE, "-o", tmp_path / "file")
    assert code == 1 and "exists and is not a folder" in err and err.count("\n") == 1


def test_the_tuner_and_its_worker_import_no_torch():
    import subprocess
    import sys

    code = "import sys, zbsearch.tuner, zbsearch.tuner.worker, zbsearch.tuner.launch; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


@pytest.mark.slow  # torchrun starts 4 processes
def test_train_gpt_runs_a_planned_cut_exactly(tmp_path, capsys):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from zbsearch.formats.edit import updated
    from zbsearch.formats.partition import Partition
    from zbsearch.formats.schedule import save_schedule

    root = Path(__file__).resolve().parents[2]
    sched = zb.build_classic("1f1b", zb.load_profile("unit-p4"), 4)
    sched = zb.build_classic("1f1b", sched.profile.model_copy(update={"stages": sched.profile.stages[:2]}), 4)
    units = ["embedding", *(f"layer.{i}" for i in range(5)), "head"]
    part = Partition(layers="gpt", units=units, kinds=["embedding", *["layer"] * 5, "head"], placement="one",
                     stages=[units[:5], units[5:]], optimizer="adamw", static_bytes=[0, 0], activation_bytes=[0, 0],
                     value=1.0, lower_bound=1.0, gap=0.0, placements_searched=["one"])
    path = tmp_path / "plan.json"
    save_schedule(updated(sched, partition=part), path)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        str(root / "examples" / "train_gpt.py"), str(path), "--dp", "2", "--steps", "2", "--check",
                        "--seq", "16", "--vocab", "96", "--heads", "2", "-b", "2"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    diffs = [float(line.split("= ")[1].split()[0]) for line in r.stdout.splitlines() if "max |grad - one process|" in line]
    assert len(diffs) == 4 and max(diffs) < 1e-5
    assert "over stages [0]" in r.stdout and "over stages [1]" in r.stdout
    bad = subprocess.run([sys.executable, str(root / "examples" / "train_gpt.py"), str(path), "--layers-per-stage", "2,2"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode != 0 and "differs from the plan's cut [4, 1]" in bad.stderr
