#!/usr/bin/env bash
# Install what the real-browser notebook tests (tests/browser/) need.
#
# Idempotent: safe to run on every CI run. Runs as root (CI and dev boxes are root).
# Chromium comes from Debian's own `chromium` package (/usr/bin/chromium);
# Playwright is used only as a driver -- NEVER run `playwright install`
# (it downloads a browser build from a host that is not reachable here).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x /usr/bin/chromium ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

# Python side: JupyterLab server + widgets front-end + Playwright driver.
python -m pip install -q \
    'jupyterlab>=4.2,<5' \
    'playwright>=1.45' \
    'ipywidgets>=8,<9' \
    'ipykernel>=6'

# Sanity checks (fast; fail loudly if something is missing).
/usr/bin/chromium --version
python -c "import playwright.sync_api, jupyterlab, ipywidgets; print('jupyterlab', jupyterlab.__version__)"
