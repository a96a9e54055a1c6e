#!/usr/bin/env bash
# Build the documentation site into site/: English at site/, Simplified Chinese at site/zh/, one search index for
# both. Strict: a warning, a broken link or anchor, a missing reference or a missing Chinese page fails the build.
# Installs what it needs on a fresh machine (torch's CPU build if no torch is installed, then this package with its
# [docs] extra). Then, where headless Chromium and Playwright are installed (bash tests/browser/INSTALL.sh), it
# takes screenshots of the getting-started page in both languages and checks that search answers in both, into
# site/_artifacts/. The interpreter is the one scripts/env.sh chooses (PYTHON=, the active environment, else the
# checkout's .venv, made here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
mj_python --create
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[docs]"
export NO_MKDOCS_2_WARNING=1
# nbconvert's templates live under the interpreter's share/jupyter; a venv made with --system-site-packages has
# the packages but not that folder, so point Jupyter at the base interpreter's one as well.
base_share=$("$PY" -c 'import os, sys; print(os.path.join(sys.base_prefix, "share", "jupyter"))')
export JUPYTER_PATH="${JUPYTER_PATH:+$JUPYTER_PATH:}$base_share"
start=$(date +%s)
"$PY" -m mkdocs build --strict --clean --site-dir site
echo "docs.sh: site built in $(( $(date +%s) - start )) s: site/ (English), site/zh/ (Chinese)"
# Chinese screenshots need a CJK font (Debian's fonts-dejavu has none): install a small one where apt works.
if [ -x /usr/bin/chromium ] && command -v fc-list >/dev/null && [ -z "$(fc-list :lang=zh 2>/dev/null)" ] \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fonts-wqy-microhei >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         --no-install-recommends fonts-wqy-microhei >/dev/null 2>&1; } \
    || echo "docs.sh: could not install fonts-wqy-microhei; Chinese text in screenshots shows as boxes" >&2
fi
rc=0
"$PY" -m doctools.screenshots --site site --out site/_artifacts || rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 2 ]; then
  exit "$rc"
fi
