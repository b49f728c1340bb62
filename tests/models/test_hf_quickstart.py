"""The Hugging Face quick start of docs/huggingface.md, run as written, and what the command line
refuses around it in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> list[str]:
    """The bash blocks of the page's Quick start section, in order."""
    text = (ROOT / "docs" / "huggingface.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def _env(tmp: Path) -> dict:
    shim = tmp / ".bin" / "zbsearch"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m zbsearch "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PATH=f"{shim.parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return env


@pytest.mark.slow
def test_the_quick_start_runs_as_written(tmp_path):
    blocks = _quickstart()
    assert len(blocks) == 2 and "torchrun" in blocks[1] and "examples/train_hf.py" in blocks[1]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # as in a checkout
    env = _env(tmp_path)
    outs = []
    for code in blocks:
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        outs.append(r.stdout)
    checks = re.findall(r"max \|grad - one process\| = (\S+)", outs[1])
    assert len(checks) == 2 and all(float(x) < 1e-6 for x in checks), outs[1]
    assert len(re.findall(r"^step +\d+ +loss", outs[1], flags=re.M)) == 20
    # the plan remembers the model it was made for: train_hf.py took its shapes from there
    model = json.loads((tmp_path / "plan.json").read_text())["profile"]["model"]
    assert model["model"] == "hf gpt2-tiny" and model["seq"] == 32 and model["microbatch_size"] == 2
    # another model on the same plan is refused in one line per rank
    r = subprocess.run(["torchrun", "--nproc-per-node", "2", "examples/train_hf.py", "plan.json", "--hf", "llama-tiny",
                        "--steps", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if "error:" in x and x.startswith("rank")]
    assert lines and all("is not the model the schedule was made for" in x for x in lines), r.stderr[-3000:]


def _train_hf():
    spec = importlib.util.spec_from_file_location("train_hf", ROOT / "examples" / "train_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps must be at least 1, not 0"),
    (["-b", "0"], "--microbatch-size must be at least 1, not 0"),
    (["--seq", "100"], "sequence length 100 exceeds the model's n_positions = 64; use --seq 64 or less"),
    (["--hf", "no-such-preset"], "neither a config JSON file, tiny:MODEL_TYPE nor a preset"),
])
def test_train_hf_refuses_in_one_line(tmp_path, monkeypatch, capsys, args, message):
    from zbsearch.app.cli import main

    plan = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as done:
        main(["schedule", "zb-h1", "-p", str(ROOT / "examples" / "uniform-p2.json"), "-m", "4", "-o", str(plan)])
    assert done.value.code in (0, None)
    monkeypatch.setattr(sys, "argv", ["train_hf.py", str(plan), *args])
    with pytest.raises(SystemExit) as done:
        _train_hf().main()
    code = done.value.code  # a string: sys.exit prints it on one line and exits 1
    assert isinstance(code, str) and code.startswith("error: ") and message in code and "\n" not in code


@pytest.mark.parametrize("args,message", [
    (["--seq", "65"], "sequence length 65 exceeds the model's n_positions = 64; use --seq 64 or less"),
    (["--stages", "9"], "8 layers cannot fill 9 stages; give layers_per_stage (--layers-per-stage on the command line)"),
    (["--layers-per-stage", "3,3,3,3"], "layers_per_stage [3, 3, 3, 3] must be 4 counts adding up to the 8 layers"),
    (["--builtin", "gpt", "--layers-per-stage", "2,2"], "--layers-per-stage applies to --hf"),
    (["--selective", "mlp"], "--selective applies with --recompute"),
    (["--recompute", "--selective", "mlp,feed_forward"], "--selective 'mlp,feed_forward': choose attention, mlp or none"),
    (["--builtin", "gpt", "--recompute", "--selective", "core"], "--selective 'core': choose attention, mlp or none"),
])
def test_profile_hf_refuses_in_one_line(tmp_path, capsys, args, message):
    from zbsearch.app.cli import main

    head = [] if "--builtin" in args else ["--hf", "gpt2-tiny"]
    with pytest.raises(SystemExit) as done:
        main(["profile", *head, *args, "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert done.value.code == 1 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "p.json").exists()


def test_hf_and_the_build_function_share_their_defaults(tmp_path):
    import inspect

    from zbsearch.models.hf import DEFAULTS, build, profile_shape

    params = inspect.signature(build).parameters
    assert {k: params[k].default for k in DEFAULTS} == DEFAULTS
    assert profile_shape("gpt2-tiny", None, None) == (DEFAULTS["seq"], DEFAULTS["microbatch_size"])
    short = tmp_path / "short.json"  # a model with fewer positions than the default sequence
    short.write_text(json.dumps(dict(model_type="gpt2", n_layer=2, n_embd=16, n_head=2, n_positions=12, vocab_size=50)))
    assert profile_shape(str(short), None, None) == (12, DEFAULTS["microbatch_size"])
    assert profile_shape(str(short), 8, 3) == (8, 3)
