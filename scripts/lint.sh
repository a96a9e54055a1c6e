#!/usr/bin/env bash
# Lint (ruff: style, import order, likely bugs) and type-check (mypy) the packages, their tests and benchmarks.
# Both read their configuration from pyproject.toml. Assumes scripts/setup.sh --dev ran (the lint extra); the
# interpreter is the one scripts/env.sh chooses.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
mj_python
"$PY" -m ruff check
"$PY" -m mypy
