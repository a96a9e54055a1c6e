#!/usr/bin/env bash
# Run the test suite: unit and integration tests, real-kernel tests, and the tutorial notebooks under nbval (stored
# outputs compared). Assumes scripts/setup.sh ran (bash .ci/run does both).
#
#   bash scripts/test.sh                          everything
#   bash scripts/test.sh tests/unit -x            only what the paths (or node ids) name, with pytest's options
#   bash scripts/test.sh -k interrupt             everything, with pytest's options
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(tests notebooks)
for arg in "$@"; do
  if [[ -e "${arg%%::*}" ]]; then  # a path or node id: run what it names instead of everything
    targets=()
    break
  fi
done
exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider --durations=25 --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
  "${targets[@]}" "$@"
