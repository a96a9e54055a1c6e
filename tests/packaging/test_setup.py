"""The set-up a newcomer gets (issue 31): the scripts choose one interpreter (scripts/env.sh), making .venv in the
checkout when no environment is active and no PYTHON= is given; the main job alone, in a fresh clone, leaves that
.venv with the quickstart's output printed and a working JupyterLab, and without the development extras."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV_SH = ROOT / "scripts" / "env.sh"
pytestmark = pytest.mark.skipif(not ENV_SH.exists(), reason="scripts/env.sh is not in an sdist; a checkout has it")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any choice of interpreter in it (as on a newcomer's machine), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV")}
    return {**env, **extra}


def choose(checkout: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``mj_python ARGS`` of the checkout's scripts/env.sh: prints PY and the note on success."""
    script = f'source scripts/env.sh && mj_python {" ".join(args)} && echo "$PY" && echo "$MJ_ENV_NOTE"'
    return subprocess.run(["bash", "-c", script], cwd=checkout, env=clean_env(**env), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A folder with the scripts' interpreter chooser, as a checkout has it."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ENV_SH, tmp_path / "scripts" / "env.sh")
    return tmp_path


def test_without_an_environment_the_set_up_makes_venv_in_the_checkout_and_says_so(checkout: Path) -> None:
    missing = choose(checkout)
    assert missing.returncode != 0 and not (checkout / ".venv").exists()
    assert "bash scripts/quickstart.sh" in missing.stderr and "bash .ci/run" in missing.stderr
    made = choose(checkout, "--create")
    assert made.returncode == 0, made.stderr
    py, note = made.stdout.splitlines()
    assert py == str(checkout / ".venv" / "bin" / "python") and Path(py).exists()
    assert note.startswith(f"the virtual environment {checkout / '.venv'}, made now")
    again = choose(checkout)
    assert again.returncode == 0 and again.stdout.splitlines() == [py, f"the virtual environment {checkout / '.venv'}"]


def test_python_or_an_active_environment_comes_first(checkout: Path, tmp_path: Path) -> None:
    venv = tmp_path / "active"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    active = choose(checkout, "--create", VIRTUAL_ENV=str(venv))
    assert active.stdout.splitlines() == [str(venv / "bin" / "python"), f"the active virtual environment {venv}"]
    named = choose(checkout, "--create", PYTHON=sys.executable, VIRTUAL_ENV=str(venv))
    assert named.stdout.splitlines() == [sys.executable, f"{sys.executable} (from PYTHON=)"]
    conda = choose(checkout, CONDA_PREFIX=str(venv), CONDA_DEFAULT_ENV="work")
    assert conda.stdout.splitlines()[0] == str(venv / "bin" / "python")
    base = choose(checkout, CONDA_PREFIX=str(venv), CONDA_DEFAULT_ENV="base")  # conda's base is nobody's project
    assert base.returncode != 0
    assert not (checkout / ".venv").exists()


def test_an_interpreter_older_than_3_11_is_refused_with_what_to_do(checkout: Path, tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Python 3.9.18'; exit 0; fi\nexit 1\n")
    old.chmod(0o755)
    refused = choose(checkout, PYTHON=str(old))
    assert refused.returncode != 0
    assert "not a working Python 3.11 or newer (Python 3.9.18)" in refused.stderr and "PYTHON=" in refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a fresh environment: about 2.5 minutes on 2 idle cores, much longer beside CI's load
def test_the_main_job_alone_in_a_fresh_clone(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    job = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=clone, env=clean_env(), capture_output=True,
                         text=True, timeout=1700)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-5000:]
    venv = clone / ".venv"
    assert f"Python environment: the virtual environment {venv}, made now" in out
    assert "[rank0]: test accuracy:" in out and "stopped 4 ranks" in out
    assert "quickstart.sh: done. Open the tutorials in JupyterLab:  .venv/bin/jupyter lab notebooks/" in out
    lab = subprocess.run([str(venv / "bin" / "jupyter"), "lab", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert lab.returncode == 0 and lab.stdout.strip()[:1].isdigit(), lab.stdout + lab.stderr
    find = ("import importlib.util as u; "
            "print(*(u.find_spec(m) is not None for m in ('pandas', 'ruff', 'mypy', 'mkdocs')))")
    present = subprocess.run([str(venv / "bin" / "python"), "-c", find], capture_output=True, text=True, timeout=120)
    assert present.stdout.split() == ["True", "False", "False", "False"], "the main job installs no development extras"
