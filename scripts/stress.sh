#!/usr/bin/env bash
# Stress mode: the integration and real-kernel tests while other processes keep every core busy, several runs in a
# row; it stops at the first run that fails. Tests must wait for the state they assert, never for a time that a
# loaded machine does not keep. Assumes scripts/setup.sh --dev ran; the interpreter is the one scripts/env.sh chooses.
#
#   bash scripts/stress.sh                                  tests/integration, 3 runs, one busy loop per core
#   bash scripts/stress.sh tests/integration/test_faults.py -x   what the arguments name (pytest's options too)
#   STRESS_RUNS=5 STRESS_LOAD=4 bash scripts/stress.sh      5 runs under 4 busy loops
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
mj_python
mj_scripts_first
RUNS=${STRESS_RUNS:-3}
LOAD=${STRESS_LOAD:-$(nproc)}
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(tests/integration)
fi

hogs=()
stop_load() {
  for pid in "${hogs[@]}"; do  # only the busy loops this script started, by pid
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${hogs[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  hogs=()
}
trap stop_load EXIT
trap 'stop_load; exit 130' INT TERM
for _ in $(seq "$LOAD"); do
  "$PY" -c "while True: pass" &
  hogs+=($!)
done
echo "stress.sh: $LOAD busy loops (pids ${hogs[*]}); $RUNS runs of: ${args[*]}"
for run in $(seq "$RUNS"); do
  start=$SECONDS
  if "$PY" -m pytest -p no:cacheprovider -q "${args[@]}"; then
    echo "stress.sh: run $run of $RUNS passed in $((SECONDS - start)) s"
  else
    echo "stress.sh: run $run of $RUNS FAILED after $((SECONDS - start)) s" >&2
    exit 1
  fi
done
echo "stress.sh: $RUNS runs in a row passed under load"
