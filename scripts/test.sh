#!/usr/bin/env bash
# Run the test suite: unit and integration tests, real-kernel tests, and the tutorial notebooks under nbval (stored
# outputs compared). Assumes scripts/setup.sh --dev ran (bash .ci/run does both); the interpreter is the one
# scripts/env.sh chooses (PYTHON=, the active environment, else the checkout's .venv).
#
#   bash scripts/test.sh                          everything
#   bash scripts/test.sh tests/unit -x            only what the paths (or node ids) name, with pytest's options
#   bash scripts/test.sh -k interrupt             everything, with pytest's options
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
mj_python
mj_scripts_first
# The test and notebooks extras (the main job's .venv has no test extra: pytest would run without its timeouts).
if ! "$PY" -c "import pytest_timeout, xdist, nbval" 2>/dev/null; then
  echo "test.sh: $PY lacks the test extra (pytest-timeout, pytest-xdist) or nbval:" \
       "run  bash scripts/setup.sh --dev  (or  bash .ci/run) first" >&2
  exit 1
fi
targets=(tests notebooks)
for arg in "$@"; do
  if [[ -e "${arg%%::*}" ]]; then  # a path or node id: run what it names instead of everything
    targets=()
    break
  fi
done
# nbval's own cell timeout comes before pytest-timeout's (300 s): nbval then interrupts the kernel, so the cell
# fails with the kernel's traceback and the notebook's later cells still run, instead of each waiting 300 s.
# pytest-xdist runs the test files on MJ_TEST_WORKERS processes (default 3; 0 runs them in this one), each file
# whole on one of them (--dist loadfile: a module's mesh or kernel is started once). Most tests wait on processes
# starting, sockets and kernels rather than compute: on 2 cores, 2 workers took the whole suite from 28.5 minutes
# (CI, one file after another) to 20 alone and 23 in CI beside its side job. Tests wait for states, never for
# times, so the order and the load they run under do not matter (scripts/stress.sh runs them under busy loops).
# `-n 0` among the arguments wins.
workers=${MJ_TEST_WORKERS:-3}
exec "$PY" -m pytest -p no:cacheprovider --durations=25 -n "$workers" --dist loadfile \
  --nbval --nbval-cell-timeout 240 --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
  "${targets[@]}" "$@"
