#!/usr/bin/env bash
# Install monarch_jupyter (editable) and what its tests and notebooks need, on a fresh machine. Idempotent.
# torch first, pinned to the CPU build this machine carries, so that the loose range in pyproject.toml does not
# pull a multi-GB CUDA build; on a GPU machine install your own CUDA build of torch before this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,notebooks,lint,lightning,frameworks,plots]"
