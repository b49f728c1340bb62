"""Print pyproject.toml's requirements, one per line, for uv or pip: the base dependencies and
every optional extra, torch left out (install.sh keeps the torch a machine has, so neither the
lock nor the oldest-versions check may choose one).

    python .ci/requirements.py            # base + every extra
    python .ci/requirements.py base dev   # only these groups
"""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
groups = {"base": project["dependencies"], **project["optional-dependencies"]}
wanted = sys.argv[1:] or list(groups)
unknown = [g for g in wanted if g not in groups]
if unknown:
    sys.exit(f"unknown group(s) {unknown}; pyproject.toml has {sorted(groups)}")
for group in wanted:
    for req in groups[group]:
        if not re.match(r"torch\b", req):
            print(req)
