"""profile --dp: each stage's gradient reduction and optimizer step in the profile, from the
stages' own parameters, so that solve then minimises the iteration."""

from __future__ import annotations

import json
import subprocess

import pytest

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.models import GPTConfig, gpt_stages
from zbsearch.profiler.gradients import gradient_bytes, optimizer_step_ms
from zbsearch.solver import solve


def test_profile_with_replicas_prices_each_stages_all_reduce_and_step(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([*cli_command(), "profile", "--builtin", "gpt", "--layers", "4", "--hidden", "64", "--seq", "32",
                        "-b", "2", "--stages", "2", "--repeat", "3", "--rounds", "1", "--warmup", "1", "--threads", "1",
                        "--dp", "8", "--dp-bandwidth", "10", "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    # the stages' trainable parameters, counted here from the model itself (float32)
    stages = gpt_stages(GPTConfig(layers=4, hidden=64, heads=4, seq=32, microbatch_size=2, stages=2))
    want = [4.0 * sum(p.numel() for p in st.parameters() if p.requires_grad) for st in stages]
    assert doc["data_parallel"]["replicas"] == 8 and doc["data_parallel"]["grad_bytes"] == pytest.approx(want)
    for st, b in zip(doc["stages"], want):
        assert st["t_reduce"] == pytest.approx(2 * 7 / 8 * b / 10e9 * 1e3)
        assert st["t_opt"] > 0
    res = solve(zb.load_profile(out), 4, "2p", time_limit=1)
    assert res.info.objective == "iteration" and max(res.schedule.predicted.iteration) > max(res.schedule.predicted.span)


def test_a_tied_weight_counts_once_and_frozen_ones_not_at_all():
    import torch

    lin = torch.nn.Linear(8, 8)
    model = torch.nn.ModuleDict({"a": lin, "b": lin, "c": torch.nn.Linear(8, 2)})
    model["c"].weight.requires_grad_(False)
    assert gradient_bytes(model) == 4 * (64 + 8 + 2)
    assert gradient_bytes(model, torch.bfloat16) == 2 * (64 + 8 + 2)
    assert optimizer_step_ms(model, torch.device("cpu")) > 0
    assert optimizer_step_ms(torch.nn.ReLU(), torch.device("cpu")) == 0.0
