#!/usr/bin/env bash
# Set up a checkout of zbsearch for development in the current Python environment (an active
# venv, or the Python named by $PYTHON):
#
#   1. torch: an existing torch >= 2.5 (CPU or CUDA) is kept as it is. Without one, pip is asked
#      for torch==2.13.0: on a machine that keeps a local CPU wheel of it (pip's find-links),
#      that wheel, instead of the multi-GB CUDA build a plain "torch" would bring.
#   2. zbsearch itself, editable, with the extras [dev] (pytest, hypothesis, ortools, ruff, mypy),
#      [hf] (transformers, for Hugging Face models) and [docs] (mkdocs, to build the documentation
#      site), at the versions pinned in
#      constraints.txt, known to work together. `bash install.sh --latest` takes the newest
#      versions pyproject.toml allows instead.
#
# README's test command, `python -m pytest`, then runs in this same environment.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
constraints=(-c constraints.txt)
case "${1:-}" in
    "") ;;
    --latest) constraints=(--upgrade --upgrade-strategy eager) ;;
    *) echo "usage: bash install.sh [--latest]" >&2; exit 2 ;;
esac
if ! "$PY" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 5))' 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
# whichever torch is there now stays: pinned for this install, so no upgrade can replace it
keep=$(mktemp)
trap 'rm -f "$keep"' EXIT
"$PY" -W ignore -c 'import torch; print("torch==" + torch.__version__)' > "$keep" 2>/dev/null
"$PY" -m pip install -q -c "$keep" "${constraints[@]}" -e ".[dev,hf,docs]"
