#!/usr/bin/env bash
# Install zbsearch and its dependencies into the current Python environment.
# torch: an existing torch (>= 2.5, CPU or CUDA) is kept as it is. Without one we ask pip for
# torch==2.13.0, which on CPU machines set up with a local wheel takes that CPU wheel instead of
# downloading the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 5))' 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[dev,hf]"
