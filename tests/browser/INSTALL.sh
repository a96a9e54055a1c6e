#!/usr/bin/env bash
# Install what the real-browser notebook tests (tests/browser/) need.
#
# Idempotent: safe to run on every CI run (a no-op apart from pip's check when all
# is installed).  Runs as root, as CI and the dev boxes do.
#
# * Chromium comes from Debian's own `chromium` package -> /usr/bin/chromium.
#   Playwright is only the driver: NEVER run `playwright install` (it downloads a
#   browser build from a host that is not reachable here).
# * Tested with: Debian 12, chromium 156.0.8078.108-1~deb12u1, Python 3.11,
#   jupyterlab 4.6.6, playwright 1.65.2, ipywidgets 8.1.9, ipykernel 7.4.0.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1
PYTHON="${PYTHON:-python}"

if ! [ -x /usr/bin/chromium ] || ! dpkg -s fonts-dejavu-core >/dev/null 2>&1; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

# JupyterLab server + ipywidgets front end (jupyterlab_widgets) + Playwright driver.
"$PYTHON" -m pip install -q \
    'jupyterlab>=4.2,<5' \
    'playwright>=1.45' \
    'ipywidgets>=8,<9' \
    'ipykernel>=6'

# Fast sanity checks; fail loudly if something is missing.
/usr/bin/chromium --version 2>/dev/null
"$PYTHON" -c "import playwright.sync_api, jupyterlab, ipywidgets; print('jupyterlab', jupyterlab.__version__, '/ ipywidgets', ipywidgets.__version__)"
