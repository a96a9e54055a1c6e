"""Rich output pieces that need no process: MIME bundles on a rank, the RankMap HTML view, charts and per-rank
output HTML, completion and inspection in a namespace, the auto-mode transformer, the metric series cap."""

from __future__ import annotations

import base64

import pytest

from monarch_jupyter.ranks import RankMap
from monarch_jupyter.richrepr import values_equal
from monarch_jupyter.widgets import model
from monarch_jupyter.widgets.outputs import render_charts
from monarch_worker import completion
from monarch_worker import protocol as P
from monarch_worker.display import FigureImage, Publisher, mime_bundle


class Rich:
    def _repr_html_(self):
        return "<b>rich</b>"

    def _repr_png_(self):
        return b"\x89PNG-bytes", {"width": 3}

    def __repr__(self):
        return "Rich()"


class Broken:
    def _repr_html_(self):
        raise ValueError("bad html")

    def __repr__(self):
        raise RuntimeError("bad repr")


def test_mime_bundle_takes_every_repr_and_survives_broken_ones():
    data, md, notes = mime_bundle(Rich())
    assert data == {"text/html": "<b>rich</b>", "image/png": b"\x89PNG-bytes", "text/plain": "Rich()"}
    assert md == {"image/png": {"width": 3}} and notes == []
    data, md, notes = mime_bundle(Broken())
    assert data == {"text/plain": "<Broken object (its repr raised RuntimeError)>"}
    assert notes == ["_repr_html_ of Broken raised ValueError: bad html",
                     "repr() of Broken raised RuntimeError: bad repr"]
    data, _, _ = mime_bundle(Rich(), exclude=["text/html"])
    assert "text/html" not in data


def test_publisher_sends_binary_raw_and_caps_displays_per_cell():
    sent: list[tuple[P.Display, list]] = []
    pub = Publisher(lambda msg, bufs: sent.append((msg, bufs)), lambda: 7)
    pub.display(Rich())
    msg, bufs = sent[0]
    assert msg.cell_id == 7 and msg.binary == ["image/png"] and bufs == [b"\x89PNG-bytes"]
    assert "image/png" not in msg.data  # no base64 on the wire
    pub.display({"image/png": base64.b64encode(b"abc").decode(), "text/plain": "x"}, raw=True)
    assert sent[1][1] == [b"abc"]  # a base64 string (IPython's Image) travels as its bytes
    pub.end_cell(7)
    sent.clear()
    from monarch_worker import display as D

    for i in range(D.MAX_PER_CELL + 5):
        pub.display(i)
    assert len(sent) == D.MAX_PER_CELL
    pub.end_cell(7)
    assert "5 more displays of this cell were not shown" in sent[-1][0].data["text/plain"]


def test_rankmap_html_only_for_rich_values_and_text_unchanged():
    plain = RankMap({0: 1, 1: 1})
    assert plain._repr_html_() is None
    same = RankMap({0: FigureImage(b"png", "<Figure>"), 1: FigureImage(b"png", "<Figure>")})
    html = same._repr_html_()
    assert "all 2 ranks equal (ranks 0,1)" in html and html.count("<img") == 1
    differ = RankMap({0: Rich(), 1: "text"})
    html = differ._repr_html_()
    assert 'class="mj-rankmap-rank" data-rank="0"' in html and "<b>rich</b>" in html and "&#x27;text&#x27;" in html
    assert "<table" not in html  # no table around the values: JupyterLab's table style would restyle it
    assert differ[1] == "text"  # indexing gives the raw values


def test_values_equal_never_raises():
    import numpy as np
    import torch

    assert values_equal(torch.ones(3), torch.ones(3)) and not values_equal(torch.ones(3), torch.zeros(3))
    assert values_equal(np.arange(3), np.arange(3)) and not values_equal(np.arange(3), np.arange(4))
    assert not values_equal(1, "1")


def test_charts_html():
    svg = render_charts({"loss": {0: [(1, 1.0), (2, 0.5)], 1: [(1, 2.0), (2, 0.25)]}})
    assert svg.count("<polyline") == 2 and 'data-metric="loss"' in svg
    assert render_charts({}) == ""


def test_metric_points_are_capped():
    class FakeMesh:
        nproc = 1

        def status(self):
            return {0: {"state": "idle"}}

        def add_listener(self, fn):
            pass

    mon = model.MeshMonitor(FakeMesh())
    mon.on_event("cell_started", {"cell_id": 1, "ranks": [0]})
    for i in range(3 * model.POINTS_KEPT):
        mon.on_event("progress", {"rank": 0, "cell_id": 1, "n": i, "total": None, "postfix": f"loss={1 / (i + 1)}"})
    series = mon.metrics(1, [0])["loss"][0]
    assert len(series) <= model.POINTS_KEPT and series[0][0] == 0 and series[-1][0] == 3 * model.POINTS_KEPT - 1


def test_completion_and_description_in_a_namespace():
    import collections

    ns = {"rank_only_name": 1, "collections": collections}
    matches, start, end = completion.complete(ns, "x = rank_on", 11)
    assert matches == ["rank_only_name"] and (start, end) == (4, 11)
    matches, _, _ = completion.complete(ns, "collections.Order", 17)
    assert matches == ["collections.OrderedDict"]
    text = completion.describe(ns, "collections.OrderedDict(", 24)
    assert "Type:      type" in text and "Docstring" in text
    assert completion.describe(ns, "nothing_here", 5) == ""


@pytest.mark.parametrize("cell,expected", [
    (["x = 1\n"], ["%%mesh\n", "x = 1\n"]),
    (["%mesh status\n"], ["%mesh status\n"]),
    (["%%local\n", "x\n"], ["%%local\n", "x\n"]),
    (["!ls\n"], ["!ls\n"]),
    (["x?\n"], ["x?\n"]),
])
def test_auto_mode_transformer(cell, expected):
    from monarch_jupyter.magics.auto import AutoMode

    auto = AutoMode(shell=None)
    assert auto.transform(list(cell)) == list(cell)  # off: unchanged
    auto.on = True
    assert auto.transform(list(cell)) == expected
