"""What every benchmark shares: where results go, and the machine they were measured on.

Every result file records the machine (CPU model, cores, load average before saving, Python and
torch versions), the commit and the date, so that a number is never read without the conditions
it was taken under (``bench/report.py`` puts them at the top of the report).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["RESULTS", "machine", "save", "save_section"]

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str | None:
    """The checkout's commit, marked ``-dirty`` when files differ from it; None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    torch = sys.modules.get("torch")
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
        "python": platform.python_version(), "torch": getattr(torch, "__version__", None),
        "commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save(doc: dict, name: str | None = None, path: Path | None = None) -> Path:
    """Write ``doc`` plus the machine to ``path`` (default ``bench/results/NAME.json``)."""
    out = path or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**doc, "machine": machine()}, indent=1) + "\n")
    print(f"saved {out}")
    return out


def save_section(path: Path, key: str, value) -> Path:
    """Put one section of a benchmark into its results file at ``path``, keeping the others
    (a benchmark run a section at a time), the machine recorded anew."""
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc.pop("machine", None)
    doc[key] = value
    return save(doc, path=path)
