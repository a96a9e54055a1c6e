#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh: .venv in the checkout unless an environment is active or PYTHON= is set),
# then run the quickstart notebook headless in IPython (4 local ranks, all_reduce, DDP training on scikit-learn's
# digits) and print what each rank printed; last, the command that opens the tutorials in JupyterLab.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
mj_python
"$PY" -m IPython --no-banner --colors=NoColor notebooks/01_quickstart.ipynb
bin=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
bin=${bin#"$PWD"/}  # .venv/bin when it is the checkout's
echo "quickstart.sh: done. Open the tutorials in JupyterLab:  $bin/jupyter lab notebooks/"
