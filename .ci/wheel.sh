#!/usr/bin/env bash
# CI: the package as a user gets it. Build a wheel (pip wheel, setuptools from this environment:
# no build isolation, so nothing is downloaded), install it into a fresh venv and run README's
# Quickstart there, from a temporary directory outside the checkout.
#
# The venv sees this environment's packages (torch, pydantic, ...) through a .pth line naming
# its site-packages, so torch is never downloaded; unlike --system-site-packages this does not
# run that folder's own .pth files, so an editable zbsearch installed there cannot shadow the
# wheel. pip still checks the wheel's declared dependencies against those packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# built from a copy of the project's files: setuptools reuses build/, where a module deleted
# since an earlier build would still sit and be packaged
mkdir "$work/src"
git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$work/src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/zbsearch-*.whl)
"$PY" - "$wheel" <<'PYEOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
top = sorted({n.split("/")[0] for n in names})
assert all(t == "zbsearch" or t.endswith(".dist-info") for t in top), f"unexpected top-level entries: {top}"
profiles = [n for n in names if n.startswith("zbsearch/profiles/") and n.endswith(".json")]
assert len(profiles) >= 14, profiles
print(f"wheel {sys.argv[1].rsplit('/', 1)[-1]}: top level {top}, {len(profiles)} bundled profiles")
PYEOF
"$PY" -m venv "$work/venv"
VPY="$work/venv/bin/python"
base=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | { read -r site; echo "$base" > "$site/_base_env.pth"; }
"$VPY" -m pip install -q --disable-pip-version-check "$wheel"
# README's Quickstart block, run line by line from an empty folder outside the checkout
quickstart=$(awk '/^## Quickstart/{on=1} on&&/^```bash/{code=1;next} code&&/^```/{exit} code&&!/^#/&&NF' README.md)
[ -n "$quickstart" ] || { echo "no Quickstart commands found in README.md" >&2; exit 1; }
mkdir "$work/run"
(
    cd "$work/run"
    export PATH="$work/venv/bin:$PATH" PYTHONPATH=
    "$VPY" - "$work/venv" <<'PYEOF'
import importlib.util, sys
import zbsearch
from zbsearch.formats.profile import BUNDLED_PROFILES
assert zbsearch.__file__.startswith(sys.argv[1]), f"zbsearch imported from {zbsearch.__file__}, not the venv"
assert importlib.util.find_spec("cli") is None, "a top-level module named cli is installed"
assert len(list(BUNDLED_PROFILES.rglob("*.json"))) >= 14, "bundled profiles missing"
PYEOF
    while IFS= read -r cmd; do
        echo "+ $cmd"
        bash -c "$cmd" > /dev/null
    done <<< "$quickstart"
    python -m zbsearch --help > /dev/null
)
echo "wheel install: Quickstart ran from $work/run"
