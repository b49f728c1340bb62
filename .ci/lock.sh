#!/usr/bin/env bash
# Refresh constraints.txt: known-good versions of every dependency of zbsearch and its extras
# (torch left out), the newest that resolve together on every Python from 3.10 up, with markers
# where a Python needs another version. install.sh installs with it; .ci/run checks the result.
#
#     bash .ci/lock.sh        # then run .ci/run and commit constraints.txt if it passes
#
# Uses uv (installed into a throwaway venv) for its cross-Python resolution.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/uv"
"$tmp/uv/bin/python" -m pip install -q uv
"$PY" .ci/requirements.py > "$tmp/requirements.in"
{
    echo "# Known-good versions of zbsearch's dependencies (all extras; torch is not pinned: install.sh"
    echo "# keeps the torch a machine has). install.sh installs with these; refresh: bash .ci/lock.sh"
    "$tmp/uv/bin/uv" pip compile - --universal --python-version 3.10 --no-header -q < "$tmp/requirements.in"
} > "$tmp/constraints.txt"
mv "$tmp/constraints.txt" constraints.txt
echo "wrote constraints.txt ($(grep -c '==' constraints.txt) pins)"
