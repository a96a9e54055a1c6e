"""A cell's live dashboard beyond the table, in process (ipywidgets without a frontend): metric charts, the cell's
output captured into the view (one copy, every item under its rank's name, the flat text in the final text/plain),
the rank tabs that filter it, and past ``fold_threshold`` ranks the tabs of the ranks that need a look plus a
selector."""

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


def _published(view) -> list[tuple[dict, bool]]:
    sent: list[tuple[dict, bool]] = []
    publish = view._publish  # noqa: SLF001 - the test records what the view sends (widgets.publish_bundle in a kernel)
    view._publish = lambda bundle, display_id, update: (sent.append((bundle, update)), publish(bundle, display_id,
                                                                                              update))
    return sent


def test_charts_tabs_and_folded_selector(mesh):
    view = cell_view(mesh, mode="widget", fold_threshold=2, defer=0)
    sent = _published(view)
    with view.capture():
        handle = mesh.run(CODE, block=False)
        with pytest.raises(MeshError):
            handle.result(60)
    view.finish()
    assert view.final and view.charts is not None and view.outputs is not None and view.segments is not None
    assert view.charts.value.count("<polyline") == 4 and 'data-metric="loss"' in view.charts.value
    titles = list(view.outputs.titles)
    assert titles[0] == "all ranks" and titles[1] == "rank 3" and titles[-1] == "other ranks"
    shown = "".join(c.value for c in view.segments.children)
    for r in range(4):  # one copy of each rank's line, under its name
        assert shown.count(f"output of rank {r}") == 1
    assert "ValueError: rank 3 fails" in view.failures.value
    assert view.picker is not None and list(view.picker.options) == [0, 1, 2, 3]
    view.picker.value = 1  # what a click in the browser does once the kernel is free
    assert "output of rank 1" in view.picked.value and "output of rank 0" not in view.picked.value
    final, update = sent[-1]
    assert update and final["text/plain"].startswith("mesh cell on ranks 0-3: error on rank 3 · done on ranks 0-2\n")
    assert sorted(final["text/plain"].splitlines()[1:]) == [f"[rank{r}]: output of rank {r}" for r in range(4)]
    mesh.run("1")  # the mesh is still usable


def test_tabs_unfolded_one_per_rank_hidden_until_it_has_something(mesh):
    view = cell_view(mesh, [0, 1], mode="widget", defer=0)
    with view.capture():
        mesh.run("if rank == 1:\n    print('only rank 1 writes')", ranks=[0, 1])
    view.finish()
    assert list(view.outputs.titles) == ["all ranks", "rank 0", "rank 1"]
    style = view.outputs.children[0].value  # the tabs filter the one copy of the output in the browser (CSS)
    assert f'.mj-cv-{view.uid}:not(:has(.mj-item[data-ranks~="0"]))' in style  # rank 0 wrote nothing: no tab
    shown = "".join(c.value for c in view.segments.children)
    assert shown.count("only rank 1 writes") == 1 and 'data-ranks=" 1 "' in shown


def test_output_outside_capture_streams_as_before(mesh, capsys):
    view = cell_view(mesh, [0, 1], mode="widget", defer=0)
    mesh.run("print('beside the view', rank)", ranks=[0, 1])
    view.finish()
    out = capsys.readouterr().out
    assert "[rank0]: beside the view 0" in out and "[rank1]: beside the view 1" in out
    assert view.output.empty()
