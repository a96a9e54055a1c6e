"""scripts/test.sh runs what its path arguments name (issue 16, item 5): extra arguments go to pytest, and a path
or node id among them replaces the whole suite. Checked by what pytest collects through the script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# The script runs pytest with nbval's options (the notebooks extra): not in the floors' environment, which has the
# test extra only (scripts/test-floors.sh).
pytest.importorskip("nbval", reason="scripts/test.sh needs nbval (the notebooks extra)")

ROOT = Path(__file__).resolve().parents[2]


def collected(*args: str) -> list[str]:
    """Node ids that ``bash scripts/test.sh ARGS --collect-only -q`` collects."""
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", "scripts/test.sh", *args, "--collect-only", "-q"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # generous: a loaded machine
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    count = re.search(r"(\d+) tests? collected", out.stdout)
    assert count and int(count.group(1)) == len(ids), out.stdout
    return ids


def test_a_path_selects_only_that_file() -> None:
    ids = collected("tests/unit/test_ranks.py")
    names = re.findall(r"^def (test_\w+)", (ROOT / "tests/unit/test_ranks.py").read_text(), re.M)
    assert {i.split("[")[0] for i in ids} == {f"tests/unit/test_ranks.py::{n}" for n in names}


def test_a_node_id_selects_one_test() -> None:
    node = "tests/unit/test_ranks.py::test_rankmap_orders_by_rank"
    assert collected(node) == [node]
