"""What every benchmark shares: where results go, and the machine they were measured on.

Every result file records the machine (CPU model, cores, load average before saving, Python and
torch versions) so that a number is never read without the conditions it was taken under.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

__all__ = ["RESULTS", "machine", "save"]

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    torch = sys.modules.get("torch")
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
        "python": platform.python_version(), "torch": getattr(torch, "__version__", None),
    }


def save(doc: dict, name: str | None = None, path: Path | None = None) -> Path:
    """Write ``doc`` plus the machine to ``path`` (default ``bench/results/NAME.json``)."""
    out = path or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**doc, "machine": machine()}, indent=1) + "\n")
    print(f"saved {out}")
    return out
