#!/usr/bin/env bash
# The main job: set up, then run the quickstart notebook headless in IPython (4 local ranks, all_reduce, DDP
# training on scikit-learn's digits) and print what each rank printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m IPython --no-banner --colors=NoColor notebooks/01_quickstart.ipynb
