#!/usr/bin/env bash
# Run the whole test suite: unit and integration tests, real-kernel tests, and the tutorial notebooks under
# nbval (stored outputs compared). Assumes scripts/setup.sh ran (bash .ci/run does both).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider tests --nbval notebooks \
  --nbval-sanitize-with notebooks/nbval_sanitize.cfg "$@"
