"""Export to torch.distributed.pipelining's CSV, and torch's own runtime replaying it."""

from __future__ import annotations

import subprocess

import pytest
import torch

import zbsearch as zb
from tests.helpers import cli_command
from tests.helpers.toy import copy_stages, toy_batch, toy_loss, toy_stages, uniform_profile
from zbsearch.distributed import run_local
from zbsearch.formats.torch_csv import to_torch_csv


def test_torch_letters_for_our_ops():
    h1 = zb.build_classic("zb-h1", uniform_profile(2), 3)
    rows = [line.split(",") for line in to_torch_csv(h1).splitlines()]
    ours = {"F": "F", "B": "I", "W": "W", "BW": "B"}
    assert rows == [
        [f"{a.stage}{ours[a.op.value]}{a.mb}" for a in row] for row in h1.rank_actions
    ]
    fused = to_torch_csv(zb.build_classic("1f1b", uniform_profile(2), 2))
    assert "I" not in fused and "W" not in fused and "0B1" in fused


def test_cli_export(tmp_path):
    sched = tmp_path / "v.json"
    zb.save_schedule(zb.build_classic("zb-v", uniform_profile(2), 4), sched)
    run = lambda *a: subprocess.run([*cli_command(), *map(str, a)], capture_output=True, text=True)  # noqa: E731
    r = run("export", sched, "--to", "torch-csv", "-o", tmp_path / "v.csv")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "v.csv").read_text() == to_torch_csv(zb.load_schedule(sched))
    r = run("export", sched, "--to", "json", "-o", "-")
    assert r.returncode == 1 and r.stderr.strip() == "error: unknown export format 'json'; supported: torch-csv, torchtitan"


def _ours_and_torch(rank: int, world: int, send, kind: str, m: int, csv_path: str) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from zbsearch.runtime import PipelineRuntime

    sched = zb.build_classic(kind, uniform_profile(world), m)
    full = toy_stages(sched.num_stages)
    ours, theirs = copy_stages(full), copy_stages(full)
    mine = [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank]
    first, last = 0 in mine, sched.num_stages - 1 in mine
    ids, targets = toy_batch(2 * m)
    PipelineRuntime(sched, {s: ours[s] for s in mine}, toy_loss, timeout=60).step(
        ids if first else None, targets if last else None
    )
    stages = [PipelineStage(theirs[s], s, sched.num_stages, torch.device("cpu")) for s in mine]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=toy_loss)
    runtime._load_csv(csv_path)
    runtime.step(*((ids,) if first else ()), target=targets if last else None)
    for s in mine:
        for (name, a), b in zip(ours[s].named_parameters(), theirs[s].parameters()):
            torch.testing.assert_close(
                a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=lambda e, s=s, name=name: f"{kind} stage {s} {name}: {e}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zb-h1", "zb-v"])
def test_torch_pipeline_runtime_replays_the_csv_with_our_gradients(kind, tmp_path):
    m = 4
    path = tmp_path / f"{kind}.csv"
    path.write_text(to_torch_csv(zb.build_classic(kind, uniform_profile(2), m)))
    run_local(_ours_and_torch, 2, kind, m, str(path))


def test_pairs_in_torch_notation_read_by_torch_parser(tmp_path):
    """Each overlapped pair is one cell that torch's own parser reads back as OVERLAP_F_B with
    our two actions in torch's letters; every other cell as before."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules._ComputationType, "OVERLAP_F_B"):
        pytest.skip("this torch has no OVERLAP_F_B")
    from zbsearch.actions import Op

    base = zb.build_classic("1f1b-split", uniform_profile(2), 4)
    pairs = []
    for row in base.rank_actions:
        at, i = [], 0
        while i < len(row) - 1:
            if row[i].op is Op.F and row[i + 1].op in (Op.B, Op.BW) and row[i].mb != row[i + 1].mb:
                at.append(i)
                i += 2
            else:
                i += 1
        pairs.append(at)
    assert any(pairs)
    sched = zb.Schedule.build("paired", base.profile, 4, base.stage_to_rank, base.rank_actions, overlapped=pairs)
    path = tmp_path / "p.csv"
    path.write_text(to_torch_csv(sched))
    runtime = schedules.PipelineScheduleMulti.__new__(schedules.PipelineScheduleMulti)
    runtime.pipeline_order = {}
    runtime._validate_and_set_stage_mapping = lambda order: None  # the parser's part only: no stages here
    runtime._load_csv(str(path))
    letters = {"F": schedules.FORWARD, "B": schedules.BACKWARD_INPUT, "W": schedules.BACKWARD_WEIGHT,
               "BW": schedules.FULL_BACKWARD}
    for r, row in enumerate(sched.compact()):
        got = runtime.pipeline_order[r]
        assert len(got) == len(row)
        for text, a in zip(row, got):
            ours = [zb.parse_action(t) for t in text.split("+")]
            parts = a.sub_actions if "+" in text else (a,)
            assert (a.computation_type == schedules.OVERLAP_F_B) == ("+" in text)
            assert [(x.stage_index, x.computation_type, x.microbatch_index) for x in parts] == [
                (o.stage, letters[o.op.value], o.mb) for o in ours]
