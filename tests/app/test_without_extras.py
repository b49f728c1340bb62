"""The command line on an install without the optional pieces.

The commands that work on schedules and profiles only (no model, no processes) run with torch
made unimportable, so they start without it; ``profile --hf`` without ``transformers`` says in
one line which extra to install. Each runs in a fresh process, where an import can be refused
(``sys.modules[name] = None`` makes ``import name`` raise ImportError).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RUN = """
import json, sys
for name in sys.argv[2].split(","):
    sys.modules[name] = None  # import name -> ImportError
from zbsearch.app.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit as e:
        codes.append(e.code)
print(json.dumps(codes))
"""


def _run(commands: list[list[str]], blocked: str, cwd: Path) -> tuple[list, str]:
    r = subprocess.run([sys.executable, "-c", _RUN, json.dumps(commands), blocked], capture_output=True, text=True,
                       cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(cwd)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1]), r.stderr


def test_schedule_commands_run_without_torch(tmp_path):
    commands = [
        ["--version"],
        ["--help"],
        ["schedule", "zb-h1", "-p", "unit-p4", "-m", "8", "-o", "zb.json"],
        ["schedule", "zb-v", "-p", "unit-p4", "-m", "8", "-o", "v.json"],
        ["simulate", "zb.json"],
        ["validate", "zb.json"],
        ["compare", "-p", "unit-p4", "-m", "8", "-t", "1"],
        ["solve", "-p", "unit-p4", "-m", "8", "--mem-limit", "1p", "-t", "2", "-o", "solved.json"],
        ["frontier", "-p", "unit-p4", "-m", "4", "-t", "2"],
        ["show", "zb.json", "v.json", "-o", "chart.png"],
        ["export", "zb.json", "--to", "torch-csv", "-o", "zb.csv"],
    ]
    codes, err = _run(commands, "torch", tmp_path)
    assert codes == [0] * len(commands), err
    assert {p.name for p in tmp_path.iterdir()} >= {"zb.json", "v.json", "solved.json", "chart.png", "zb.csv"}


def test_profile_hf_without_transformers_names_the_extra(tmp_path):
    codes, err = _run([["profile", "--hf", "gpt2-tiny", "--stages", "2", "-o", "p.json"]], "transformers", tmp_path)
    lines = err.strip().splitlines()
    assert codes == [1] and len(lines) == 1, err
    assert "zbsearch[hf]" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_version_is_the_package_version(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zbsearch", "--version"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    from zbsearch import __version__

    assert r.returncode == 0 and r.stdout.strip() == f"zbsearch {__version__}", r
