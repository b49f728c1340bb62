#!/usr/bin/env bash
# CI: the package as a user gets it. `bash .ci/wheel.sh SRC WORK`: build a wheel of the project
# in SRC, install it with its dependencies (the newest the index has, no constraints) into a new
# venv that holds only torch (this machine's wheel, as a user's own torch), and from an empty
# folder outside the checkout run: `zbsearch --version`, README's Quickstart line by line, one
# usage error (one line, exit 2), `profile` and `solve` on a tiny model, and `profile --hf`
# without the [hf] extra (one line naming it).
set -euo pipefail
src=$(cd "$1" && pwd)
work=$2
PY=${PYTHON:-python3}
mkdir -p "$work"
"$PY" -m pip wheel -q --no-deps -w "$work/dist" "$src" 2>&1 | grep -v "is ignored" || true
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
"$VPY" -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
"$VPY" -m pip install -q "$wheel" 2>&1 | grep -v "is ignored" || true
"$VPY" -m pip list 2>/dev/null | grep -iE '^(typer|click|pydantic|rich|pulp|highspy|networkx|matplotlib|transformers) ' | tr -s ' ' | paste -sd, -
# README's Quickstart block, run line by line from an empty folder outside the checkout
quickstart=$(awk '/^## Quickstart/{on=1} on&&/^```bash/{code=1;next} code&&/^```/{exit} code&&!/^#/&&NF' "$src/README.md")
[ -n "$quickstart" ] || { echo "no Quickstart commands found in README.md" >&2; exit 1; }
mkdir "$work/run"
cd "$work/run"
export PATH="$work/venv/bin:$PATH" PYTHONPATH=
"$VPY" - "$work/venv" <<'PYEOF'
import importlib.util, sys
import zbsearch
from zbsearch.formats.profile import BUNDLED_PROFILES
assert zbsearch.__file__.startswith(sys.argv[1]), f"zbsearch imported from {zbsearch.__file__}, not the venv"
assert importlib.util.find_spec("cli") is None, "a top-level module named cli is installed"
assert importlib.util.find_spec("transformers") is None, "transformers installed without the [hf] extra"
assert len(list(BUNDLED_PROFILES.rglob("*.json"))) >= 14, "bundled profiles missing"
PYEOF
echo "+ zbsearch --version: $(zbsearch --version)"
while IFS= read -r cmd; do
    echo "+ $cmd"
    bash -c "$cmd" > /dev/null
done <<< "$quickstart"
python -m zbsearch --help > /dev/null
# the loop's first two steps on the base install: measure a tiny model, solve on its profile
for cmd in "zbsearch profile --builtin gpt --layers 2 --hidden 32 --seq 16 -b 2 --stages 2 --repeat 3 --rounds 1 -o tiny.json" \
           "zbsearch solve -p tiny.json -m 4 -t 3 -o tiny-solved.json"; do
    echo "+ $cmd"
    bash -c "$cmd" > /dev/null 2>&1 || { bash -c "$cmd"; exit 1; }
done
one_line() {  # one_line CODE WORDS ARGS...: the command fails with CODE and one line holding WORDS
    local code=$1 words=$2; shift 2
    set +e; zbsearch "$@" > "$work/out.txt" 2> "$work/err.txt"; local rc=$?; set -e
    if [ "$rc" != "$code" ] || [ "$(wc -l < "$work/err.txt")" != 1 ] || ! grep -q -- "$words" "$work/err.txt"; then
        echo "zbsearch $*: exit $rc, expected $code and one line with '$words':" >&2; cat "$work/err.txt" >&2; exit 1
    fi
    echo "+ zbsearch $* -> exit $rc: $(cat "$work/err.txt")"
}
one_line 2 "No such option" schedule 1f1b -p unit-p4 -m 8 --bogus
one_line 1 "zbsearch\[hf\]" profile --hf gpt2-tiny --stages 2 -o p.json
echo "wheel install: Quickstart ran from $work/run"
