#!/usr/bin/env bash
# The oldest environment CI tests: every requirement of pyproject.toml at its floor (pinned by scripts/floors.py),
# in a fresh venv without the machine's packages, the package installed from a wheel built from its sdist with
# the oldest setuptools allowed (not editable). Then, from another folder, the smoke test of the installed package
# with nothing but its declared dependencies (tests/packaging/smoke.py); then, with the test extra added, the unit
# and real-kernel tests. Extra arguments go to both pytest runs. Needs `build` beside the interpreter scripts/env.sh
# chooses (the test extra: scripts/setup.sh --dev).
#
# torch at its floor is a CUDA build from PyPI: 2.7 GB to download, 5 GB installed. uv (installed into the venv)
# keeps what it downloaded in its cache (~/.cache/uv, or $UV_CACHE_DIR) and links it from there, so only the first
# run on a machine downloads it: about 40 s, then seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
source scripts/env.sh
mj_python
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mj-floors.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SECONDS=0
quiet() {  # run "$@", print its output only if it fails
  "$@" > "$WORK/out.log" 2>&1 || { cat "$WORK/out.log" >&2; return 1; }
}

"$PY" scripts/floors.py --extra test --build > "$WORK/constraints.txt"
echo "test-floors: pinned to the floors of pyproject.toml: $(tr '\n' ' ' < "$WORK/constraints.txt")"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
quiet "$VPY" -m pip install uv
install() { "$WORK/venv/bin/uv" pip install -q --python "$VPY" -c "$WORK/constraints.txt" "$@"; }

quiet "$PY" -m build --sdist -o "$WORK/dist" .
install setuptools
quiet "$VPY" -m pip wheel --no-deps --no-build-isolation -w "$WORK/dist" "$WORK"/dist/*.tar.gz
WHEEL=$(ls "$WORK"/dist/*.whl)
install "$WHEEL"
echo "test-floors: built and installed in ${SECONDS}s"
(cd "$WORK" && "$VPY" "$REPO/tests/packaging/smoke.py")

install "monarch-jupyter[test] @ file://$WHEEL"
echo "test-floors: ready in ${SECONDS}s"
"$VPY" scripts/versions.py "test-floors: the oldest environment"
"$VPY" scripts/versions.py --check oldest  # docs/installation.md's table names what this environment has
"$VPY" -m pytest -p no:cacheprovider -q tests/unit "$@"
"$VPY" -m pytest -p no:cacheprovider -q -m kernel tests/integration "$@"
