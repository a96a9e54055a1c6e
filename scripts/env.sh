# Sourced by the scripts (not run): sets PY, the Python interpreter they all install into and run, chosen as
#
#   1. $PYTHON, when it is set: that interpreter (PYTHON=/path/to/bin/python bash scripts/...);
#   2. the active virtual environment ($VIRTUAL_ENV), or an active conda environment other than base;
#   3. otherwise .venv in the checkout: `mj_python --create` makes it with `python3 -m venv` when it is missing
#      (the set-up scripts do); without --create a missing .venv is an error that says which command makes it.
#
# So after `bash scripts/quickstart.sh` on a machine without an active environment, every script, and you, use
# .venv: `.venv/bin/jupyter lab notebooks/`, or `source .venv/bin/activate`.

MJ_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MJ_VENV="$MJ_ROOT/.venv"

mj_scripts_first() {  # the environment's own commands (torchrun, jupyter) first on the PATH, as activating it would:
  # tests that launch torchrun would otherwise wait for ranks that never start, in a shell with no environment active
  PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
  export PATH
}

mj_python() {  # [--create]: set PY (and MJ_ENV_NOTE, one line saying which interpreter and why)
  local create=${1:-}
  if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
    MJ_ENV_NOTE="$PY (from PYTHON=)"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PY="$VIRTUAL_ENV/bin/python"
    MJ_ENV_NOTE="the active virtual environment $VIRTUAL_ENV"
  elif [ -n "${CONDA_PREFIX:-}" ] && [ "${CONDA_DEFAULT_ENV:-base}" != base ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
    PY="$CONDA_PREFIX/bin/python"
    MJ_ENV_NOTE="the active conda environment $CONDA_PREFIX"
  else
    PY="$MJ_VENV/bin/python"
    if [ -x "$PY" ]; then
      MJ_ENV_NOTE="the virtual environment $MJ_VENV"
    elif [ "$create" = --create ]; then
      mj_make_venv || return 1
      MJ_ENV_NOTE="the virtual environment $MJ_VENV, made now (no environment was active and PYTHON= was not set)"
    else
      echo "$(basename "$0"): no Python environment: no PYTHON=, no active virtual environment, and no $MJ_VENV;" \
           "run  bash scripts/quickstart.sh  (the main job) or  bash .ci/run  (the tests) first: they make it" >&2
      return 1
    fi
  fi
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    local fix="use another: PYTHON=/path/to/python3.11 bash $0, or make .venv yourself: python3.11 -m venv .venv"
    [ "$PY" = "$MJ_VENV/bin/python" ] && fix="remove $MJ_VENV (rm -r $MJ_VENV) and run this again, or $fix"
    local found
    found=$("$PY" --version 2>&1) || found="it does not run"
    echo "$(basename "$0"): $PY is not a working Python 3.11 or newer ($found); $fix" >&2
    return 1
  fi
}

mj_make_venv() {  # python3 -m venv .venv, with a clear error when python3 is too old or cannot make one
  local base=python3
  if ! command -v "$base" >/dev/null; then
    echo "$(basename "$0"): no python3 on the PATH to make $MJ_VENV with; install Python 3.11 or newer," \
         "or set PYTHON=/path/to/python" >&2
    return 1
  fi
  if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "$(basename "$0"): python3 is $("$base" --version 2>&1); monarch_jupyter needs Python 3.11 or newer." \
         "Make the environment with a newer one yourself (python3.11 -m venv .venv) and run this again" >&2
    return 1
  fi
  local existed=0
  [ -e "$MJ_VENV" ] && existed=1
  "$base" -m venv "$MJ_VENV" || {
    [ "$existed" = 1 ] || rm -rf "$MJ_VENV"  # half made by us (Debian without python3-venv makes one without pip)
    echo "$(basename "$0"): python3 -m venv $MJ_VENV failed (above)" >&2
    return 1
  }
}
