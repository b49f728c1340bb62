"""How long the command line takes to start: the commands that need no torch against Python's
own start and against importing torch.

Each command runs ``--repeat`` times as a new process (the installed ``zbsearch``, else
``python -m zbsearch``), alternating commands so that drift hits all alike; the median and
quartiles of the wall time are saved to ``bench/results/startup.json``. A command that imported
torch is marked (it is run once more with ``-X importtime``).

    python bench/startup.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import cli_command  # noqa: E402

COMMANDS = {
    "zbsearch --version": ["--version"],
    "zbsearch --help": ["--help"],
    "schedule zb-h1 (p=4, m=8)": ["schedule", "zb-h1", "-p", "unit-p4", "-m", "8", "-o", "zb.json"],
    "simulate": ["simulate", "zb.json"],
    "validate": ["validate", "zb.json"],
    "solve --no-milp (p=4, m=8)": ["solve", "-p", "unit-p4", "-m", "8", "--no-milp", "-o", "s.json"],
}
BASELINES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def _imports_torch(cmd: list[str], cwd: str) -> bool:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "zbsearch", *cmd[len(cli_command()):]],
                       capture_output=True, text=True, cwd=cwd)
    return any(line.rstrip().endswith("| torch") for line in r.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cwd:
        cmds = {name: [*cli_command(), *argv] for name, argv in COMMANDS.items()} | BASELINES
        for cmd in cmds.values():  # warm the file cache; also makes zb.json for simulate/validate
            subprocess.run(cmd, capture_output=True, cwd=cwd, check=True)
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.repeat):
            for name, cmd in cmds.items():
                t = time.perf_counter()
                subprocess.run(cmd, capture_output=True, cwd=cwd, check=True)
                times[name].append((time.perf_counter() - t) * 1e3)
        rows = []
        for name, ts in times.items():
            q1, med, q3 = statistics.quantiles(ts, n=4)
            torch = _imports_torch(cmds[name], cwd) if name in COMMANDS else name.endswith("torch'")
            rows.append({"command": name, "median_ms": med, "q1_ms": q1, "q3_ms": q3, "imports_torch": torch})
            print(f"{name:32s} {med:7.0f} ms  (quartiles {q1:.0f}-{q3:.0f})  {'torch' if torch else ''}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    save({"bench": "startup", "repeat": args.repeat, "commit": commit, "date": time.strftime("%Y-%m-%d"), "rows": rows},
         "startup")


if __name__ == "__main__":
    main()
