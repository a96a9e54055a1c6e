"""Fixtures for the packaging tests: the sdist and wheel of this checkout, built once per session."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


def run(cmd: list[str], cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; raise with its output when it fails."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """``python -m build`` of this checkout: the sdist, and the wheel built from that sdist."""
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip(f"no pyproject.toml in {ROOT}")
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])
    (sdist,), (wheel,) = list(out.glob("*.tar.gz")), list(out.glob("*.whl"))
    return Dists(sdist, wheel)
