#!/usr/bin/env bash
# Install monarch_jupyter (editable) and what it needs, on a fresh machine. Idempotent.
#
#   bash scripts/setup.sh          the main job's set-up (bash scripts/quickstart.sh runs it): the package with the
#                                  extras the tutorials need, JupyterLab included (notebooks, plots, lightning)
#   bash scripts/setup.sh --dev    the tests' set-up (bash .ci/run runs it): also the test, lint and type-check,
#                                  third-party framework and documentation extras
#
# Where: scripts/env.sh chooses the interpreter: PYTHON= if set, else the active virtual environment, else .venv
# in the checkout, made here when missing. It says which.
#
# torch first, when `import torch` fails: torch==2.13.0 (CI's machines carry its CPU build; from PyPI's default
# index on Linux it is a CUDA build of several GB). A torch that imports is kept, whatever its build: pip keeps any
# that satisfies torch>=2.4. To get the CPU build on a machine without a GPU, install it into the environment first
# from PyTorch's CPU index (docs/installation.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

extras=notebooks,plots,lightning,ft
case "${1:-}" in
  "") ;;
  --dev) extras=test,notebooks,plots,lightning,ft,sweep,frameworks,lint,docs ;;
  *) echo "usage: bash scripts/setup.sh [--dev]" >&2; exit 2 ;;
esac

mj_python --create
echo "setup.sh: Python environment: $MJ_ENV_NOTE"
start=$SECONDS
log=$(mktemp "${TMPDIR:-/tmp}/mj-setup.XXXXXX")
trap 'rm -f "$log"' EXIT
pip_install() {  # pip install "$@", its output shown only if it fails
  "$PY" -m pip install "$@" > "$log" 2>&1 || {
    cat "$log" >&2
    echo "setup.sh: pip install $* failed (its output is above)" >&2
    exit 1
  }
}

if torch_version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "setup.sh: torch $torch_version is installed: kept"
else
  echo "setup.sh: no torch in this environment: installing torch==2.13.0"
  pip_install "torch==2.13.0"
fi
echo "setup.sh: installing monarch-jupyter (editable) with its extras $extras"
pip_install -e ".[$extras]"
echo "setup.sh: done in $((SECONDS - start)) s"
