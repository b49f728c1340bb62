#!/usr/bin/env bash
# CI: build the documentation site (mkdocs.yml: docs/, API pages from docstrings, bench reports)
# with warnings as errors, into a temporary folder. Needs the docs extra: pip install -e '.[docs]'.
# The code blocks of the pages are run by tests/docs/test_examples.py, not here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null \
    || { echo "docs: mkdocs, mkdocs-material or mkdocstrings[python] missing: pip install -e '.[docs]'" >&2; exit 1; }
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --site-dir "$site"
echo "docs: site built with no warnings ($(find "$site" -name '*.html' | wc -l) pages)"
