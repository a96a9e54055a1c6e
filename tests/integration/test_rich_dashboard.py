"""A cell's live dashboard beyond the table, in process (ipywidgets without a frontend): metric charts, each
rank's output in a tab, and past ``fold_threshold`` ranks the tabs of the ranks that need a look plus a selector."""

from __future__ import annotations

import pytest

from monarch_jupyter import MeshError
from monarch_jupyter.widgets import cell_view

pytestmark = pytest.mark.timeout(120)

CODE = """
from monarch_worker import progress
for i in range(5):
    progress(i + 1, 5, loss=1.0 / (i + 1) + rank)
print(f"output of rank {rank}")
if rank == 3:
    raise ValueError("rank 3 fails")
"""


def test_charts_tabs_and_folded_selector(mesh):
    view = cell_view(mesh, mode="widget", fold_threshold=2, defer=0)
    handle = mesh.run(CODE, block=False)
    with pytest.raises(MeshError):
        handle.result(60)
    view.finish()
    assert view.final and view.charts is not None and view.outputs is not None
    assert view.charts.value.count("<polyline") == 4 and 'data-metric="loss"' in view.charts.value
    titles = list(view.outputs.titles)
    assert titles[0] == "rank 3" and titles[-1] == "other ranks"  # the failed rank, then the selector
    assert "output of rank 3" in view.outputs.children[0].value
    assert view.picker is not None and list(view.picker.options) == [0, 1, 2, 3]
    view.picker.value = 1  # what a click in the browser does once the kernel is free
    assert "output of rank 1" in view.picked.value and "output of rank 0" not in view.picked.value
    mesh.run("1")  # the mesh is still usable


def test_tabs_unfolded_one_per_rank_that_wrote(mesh):
    view = cell_view(mesh, [0, 1], mode="widget", defer=0)
    mesh.run("if rank == 1:\n    print('only rank 1 writes')", ranks=[0, 1])
    view.finish()
    assert list(view.outputs.titles) == ["rank 1"]
    assert "only rank 1 writes" in view.outputs.children[0].value
