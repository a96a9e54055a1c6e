"""The getting-started page and the guides, run as a user would: each page's cells in order in a fresh Jupyter
kernel (files written, shell commands run), and what they print compared with the output the page shows."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from doctools import runner, structure

from .test_structure import CHECKED_PAGES

pytestmark = [pytest.mark.kernel, pytest.mark.slow]


@pytest.mark.parametrize("name", CHECKED_PAGES)
def test_page_runs_and_prints_what_it_shows(name: str, tmp_path: Path) -> None:
    blocks, problems = runner.blocks((structure.DOCS / name).read_text(encoding="utf-8"))
    assert not problems
    t0 = time.monotonic()
    runner.run(blocks, tmp_path, timeout=240)
    took = time.monotonic() - t0
    mismatches = [m for b in blocks if (m := runner.mismatch(b))]
    assert not mismatches, f"{name}:\n" + "\n\n".join(mismatches)
    checked = sum(b.expected is not None for b in blocks)
    print(f"{name}: {len(blocks)} blocks run, {checked} outputs compared, {took:.1f} s")
