"""Selective recomputation of a Hugging Face model from the command line to training: the
profile measures the declared modules' costs, and examples/train_hf.py runs a schedule with RS
passes on them with gradients equal to the unsplit model's."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zbsearch as zb
from zbsearch.actions import Op

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_hf_stages_declare_each_layers_modules_by_mode_and_refuse_what_a_layer_lacks():
    from torch import nn

    from zbsearch.errors import ZbError
    from zbsearch.models.hf import hf_config, hf_model, hf_stages
    from zbsearch.runtime.selective import selected_modules

    model = hf_model(hf_config("llama-tiny"))
    cut = hf_stages(model, 2, selective=["attention", "mlp"])
    for stage in cut.stages:
        assert [type(m).__name__ for m in selected_modules(stage, "mlp")] == ["LlamaMLP"] * len(stage.layers)
        assert [type(m).__name__ for m in selected_modules(stage, "attention")] == ["HFCoreAttention"] * len(stage.layers)
    # the attention modules call their cores; the model's own config and masks are untouched
    assert model.config._attn_implementation == "eager"
    assert all(layer.self_attn.config._attn_implementation != "eager" for layer in model.model.layers)
    with pytest.raises(ZbError, match="unknown mode 'ffn'; choose attention, mlp"):
        hf_stages(hf_model(hf_config("llama-tiny")), 2, selective=["ffn"])
    from zbsearch.models.hf.stages import _declare_selective

    layer = nn.Sequential(nn.Linear(2, 2))  # a layer with neither
    with pytest.raises(ZbError, match=r"layer 0 \(Sequential\) has no module named mlp or feed_forward.*its modules: 0"):
        _declare_selective([layer], ["mlp"])
    with pytest.raises(ZbError, match=r"layer 0 \(Sequential\) has no attention module that calls transformers'"):
        _declare_selective([layer], ["attention"])


@pytest.mark.slow
def test_profiled_selectively_a_schedule_with_rs_passes_trains_exactly(tmp_path):
    from tests.runtime.test_selective_runtime import random_selective, selective_only

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "zbsearch", "profile", "--hf", "llama-tiny", "--stages", "2", "--seq", "16",
                        "-b", "2", "--warmup", "1", "--repeat", "3", "--rounds", "1", "--recompute", "--selective", "mlp",
                        "-o", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = zb.load_profile(out)
    assert prof.selective == "mlp"
    assert all(st.m_fs is not None and 0 < st.m_fs < st.m_f and st.t_rs > 0 for st in prof.stages)
    # RS on about half the forwards of ZB-H1 (the profile offers only selective recomputation)
    base = zb.build_classic("zb-h1", selective_only(prof), 4)
    rows = random_selective(base.rank_actions, random.Random(4), 0.5, fuse=False)
    assert sum(a.op is Op.RS for row in rows for a in row) >= 2
    plan = tmp_path / "plan.json"
    plan.write_text(zb.Schedule.build("zb-h1-rs", base.profile, 4, list(base.stage_to_rank), rows).model_dump_json())
    r = subprocess.run(["torchrun", "--nproc-per-node", "2", str(ROOT / "examples" / "train_hf.py"), str(plan),
                        "--steps", "2", "--check"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    checks = re.findall(r"max \|grad - one process\| = (\S+)", r.stdout)
    assert len(checks) == 2 and all(float(x) < 1e-6 for x in checks), r.stdout
