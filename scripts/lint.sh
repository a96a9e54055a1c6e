#!/usr/bin/env bash
# Lint (ruff: style, import order, likely bugs) and type-check (mypy) the packages, their tests and benchmarks.
# Both read their configuration from pyproject.toml. Assumes scripts/setup.sh ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check
"$PY" -m mypy
