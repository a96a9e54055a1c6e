"""32 ranks on one host: the dashboard folds into a per-state summary plus stragglers and failed ranks."""

from __future__ import annotations

import re
import time

import pytest

from monarch_jupyter import Mesh, MeshError
from monarch_jupyter.widgets import cell_view

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CODE = """
import time
from monarch_worker import progress
steps = 6
for i in range(steps):
    time.sleep(0.6 if rank == 7 else 0.05)
    progress(i + 1, steps)
if rank == 9:
    raise ValueError("rank 9 fails")
"""


def test_32_ranks_fold_to_summary_stragglers_and_failures():
    mesh = Mesh(32, start_timeout=180)
    try:
        view = cell_view(mesh, mode="widget", fold_threshold=16, defer=0)
        handle = mesh.run(CODE, block=False)
        # While rank 7 lags: the folded view names it and the failed rank 9, not the 30 healthy ranks.
        deadline = time.monotonic() + 60
        folded = ""
        while time.monotonic() < deadline and not handle.done():
            html = view.widget.html.value
            if 'data-rank="9" data-state="error"' in html and 'data-rank="7" data-state="running"' in html:
                folded = html
                break
            time.sleep(0.05)
        assert folded, view.widget.html.value
        assert 'class="mj-summary"' in folded
        assert re.findall(r'<tr class="mj-row" data-rank="(\d+)"', folded) == ["7", "9"]
        assert "slowest: rank 7" in folded
        with pytest.raises(MeshError):
            handle.result(60)
        view.finish()
        # The full table is there on demand, one row per rank, final states.
        full = view.widget.full.value
        states = dict(re.findall(r'data-rank="(\d+)" data-state="(\w+)"', full))
        assert len(states) == 32
        assert states.pop("9") == "error" and set(states.values()) == {"done"}
        assert view.widget._repr_mimebundle_()["text/plain"] == "mesh cell on ranks 0-31"
        assert len(view.widget.children) == 2  # header/summary + the accordion with the full table
    finally:
        mesh.stop()
