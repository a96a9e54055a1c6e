#!/usr/bin/env bash
# The GPU check (issue 30, item 7): one command for a machine with NVIDIA GPUs, done within 8 minutes. It starts NCCL
# meshes after the kernel touched CUDA, pushes and pulls CUDA tensors, reads the dashboard's CUDA memory, fits with
# Lightning on the GPU, runs a DDP step and all_reduce busbw against torchrun, and releases stuck NCCL collectives;
# each check in its own process under its own timeout, PASS/FAIL/SKIP per check, then a summary. Where no CUDA
# device is visible it prints "no CUDA device: skipped" and exits 0. bench/gpu_check.py has the details.
#
#   PYTHON=python3 bash scripts/gpu-check.sh                       every check (budget 450 s)
#   PYTHON=python3 bash scripts/gpu-check.sh --only hang_force     one check; --list names them; --json PATH
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
mj_python
exec "$PY" bench/gpu_check.py "$@"
