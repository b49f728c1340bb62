"""The profiler's recomputation costs: the checkpointed forward's time (t_fc), the recompute
pass's (t_r) and what the checkpointed forward keeps (m_fc), which must be what the runtime's
checkpoint holds (the stage inputs that need a gradient and the generator state, counted
independently here). Older profiles without them load and offer no recomputation; a profile
the command wrote with them drives ``solve --recompute auto`` to a schedule that recomputes, and
``--recompute full`` to one with an R pass for every forward and no RS."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from torch import nn

import zbsearch as zb
from tests.helpers import cli_command
from zbsearch.costs import CostModel
from zbsearch.pooling import pool_profiles
from zbsearch.profiler.measure import measure_stage


class Block(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 24) if first else None
        self.fc = nn.Linear(24, 48)
        self.out = nn.Linear(48, 24)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        return h + self.drop(self.out(torch.relu(self.fc(h))))


@pytest.mark.parametrize("first", [False, True])
def test_measure_stage_measures_what_a_checkpointed_forward_keeps(first):
    torch.manual_seed(0)
    st = Block(first)
    x = torch.randint(0, 11, (3, 10)) if first else torch.randn(3, 10, 24, requires_grad=True)
    got = measure_stage(st, (x,), None, torch.device("cpu"), 1, 3, recompute_too=True)
    rng = torch.get_rng_state().nbytes
    assert got.m_fc == rng + (0 if first else x.nbytes)  # a first stage's inputs are the batch: not counted
    cost = got.cost()
    assert cost.t_fc is not None and cost.t_fc > 0 and cost.t_r is not None and cost.t_r > 0
    assert cost.m_fc == got.m_fc < cost.m_f
    assert {"t_fc", "t_r"} <= set(got.record())
    plain = measure_stage(st, (x,), None, torch.device("cpu"), 1, 2)
    assert plain.cost().t_r is None and plain.cost().m_fc is None and "t_r" not in plain.record()


def test_rounds_pool_recompute_costs_where_every_round_has_them():
    def prof(t_r, m_fc):
        extra = {} if t_r is None else {"t_r": t_r, "t_fc": 1.1, "m_fc": m_fc}
        return zb.Profile(name="x", memory_unit="bytes",
                          stages=[zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=100.0, m_b=-60.0, m_w=-40.0, **extra)])
    pooled = pool_profiles([prof(1.0, 10.0), prof(3.0, 30.0), prof(2.0, 20.0)])
    assert (pooled.stages[0].t_r, pooled.stages[0].m_fc) == (2.0, 20.0)
    assert pooled.stages[0].t_r is not None
    mixed = pool_profiles([prof(1.0, 10.0), prof(None, None), prof(2.0, 20.0)])
    assert mixed.stages[0].t_r is None and mixed.stages[0].m_fc is None


def _cli(*args, cwd):
    return subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ), timeout=300)


@pytest.mark.slow
def test_profile_recompute_drives_solve_recompute_auto(tmp_path):
    r = _cli("profile", "--builtin", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
             "--stages", "2", "--warmup", "1", "--repeat", "3", "--threads", "1", "--recompute", "-o", "p.json",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    for st, spread in zip(doc["stages"], doc["measured"]["stages"]):
        assert st["t_fc"] > 0 and st["t_r"] > 0 and 0 < st["m_fc"] < st["m_f"]
        assert spread["t_fc"]["median"] > 0 and spread["t_r"]["median"] > 0
        # the built-in GPT declares its MLPs for selective recomputation
        assert st["t_fs"] > 0 and st["t_rs"] > 0 and st["m_fc"] < st["m_fs"] < st["m_f"]
        assert spread["t_fs"]["median"] > 0 and spread["t_rs"]["median"] > 0
    prof = zb.Profile.model_validate(doc)
    assert CostModel.from_profile(prof, [0, 1]).can_recompute
    # an older file, without the fields: loads, and offers no recomputation
    fields = ("t_fc", "t_r", "t_rf", "m_fc", "t_fs", "t_rs", "m_fs")
    old = {**doc, "stages": [{k: v for k, v in st.items() if k not in fields} for st in doc["stages"]]}
    assert not CostModel.from_profile(zb.Profile.model_validate(old), [0, 1]).can_recompute

    # at 0.6p a rank holds less than two microbatches: only recomputation keeps more in flight
    r = _cli("solve", "-p", "p.json", "-m", "4", "--mem-limit", "0.6p", "--recompute", "auto", "-t", "2", "-o", "s.json",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    sched = zb.Schedule.model_validate_json((tmp_path / "s.json").read_text())
    assert any(a.op in (zb.Op.R, zb.Op.RS) for row in sched.rank_actions for a in row)
    assert zb.find_problem(sched) is None
    # --recompute full: every forward, by full recomputation only
    r = _cli("solve", "-p", "p.json", "-m", "4", "--mem-limit", "0.6p", "--recompute", "full", "-t", "2", "-o", "f.json",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    full = zb.Schedule.model_validate_json((tmp_path / "f.json").read_text())
    ops = [a.op for row in full.rank_actions for a in row]
    assert ops.count(zb.Op.R) == ops.count(zb.Op.F) and zb.Op.RS not in ops
