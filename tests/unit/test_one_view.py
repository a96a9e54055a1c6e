"""One view per cell, without processes: the output sink of kernel/output.py, the cell's output record, the HTML of
its items (labels, stderr, escaping), the charts (global step, robust scale, legend, shared lines) and the running
step count behind them."""

from __future__ import annotations

import contextvars
import io
import re
import sys
from types import SimpleNamespace

from monarch_jupyter.kernel.output import OUTPUT_SINK, write_lines
from monarch_jupyter.widgets import model
from monarch_jupyter.widgets.outputs import render_charts, render_failure, render_items
from monarch_jupyter.widgets.record import CellOutput
from monarch_jupyter.widgets.text import fmt_memory, table_text


class Rich:
    """What kernel.rich.RichOutput offers a sink: rank, kind, data, display_id."""

    def __init__(self, rank: int, kind: str = "display", data: dict | None = None, display_id: str = "") -> None:
        self.rank, self.kind, self.data, self.display_id = rank, kind, data or {}, display_id

    def publish(self) -> None:  # what write_lines calls when no sink takes it
        print(f"PUBLISHED {self.data.get('text/plain')}")


class _IdleMesh:
    """What MeshMonitor reads of a mesh when it is made: ``nproc`` idle ranks (the monitor's events come from the
    test)."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc

    def status(self) -> dict[int, dict]:
        return {r: {"state": "idle"} for r in range(self.nproc)}

    def add_listener(self, fn: object) -> None:
        pass


def test_a_sink_in_the_context_takes_the_lines_instead_of_the_streams(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    record = CellOutput()
    ctx = contextvars.copy_context()
    ctx.run(OUTPUT_SINK.set, record.take)
    write_lines([(0, "stdout", "to the view")], ctx)
    write_lines([(1, "stdout", "to the stream")])  # another context: no sink there
    assert out.getvalue() == "[rank1]: to the stream\n"
    assert record.text() == "[rank0]: to the view"
    record.close()  # a closed record refuses: the output is written as usual
    write_lines([(0, "stdout", "late"), (0, "display", Rich(0, data={"text/plain": "[rank0]: fig"}))], ctx)
    assert out.getvalue().endswith("[rank0]: late\nPUBLISHED [rank0]: fig\n")


def test_a_record_closes_only_when_nothing_came_since_the_version_its_view_rendered():
    record = CellOutput()
    record.take([(0, "stdout", "shown")])
    seen = record.version
    record.take([(1, "stdout", "came between the render and the close")])
    assert record.close(seen) is False and not record.closed  # the view renders it first
    assert record.take([(1, "stdout", "still taken")])
    assert record.close(record.version) is True and record.closed
    assert not record.take([(0, "stdout", "after the close")])
    assert record.text().splitlines() == ["[rank0]: shown", "[rank1]: came between the render and the close",
                                          "[rank1]: still taken"]
    assert record.close(0) is True  # closed stays closed


def test_the_writer_calls_then_after_the_lines_queued_before_it(monkeypatch):
    """``OutputWriter.then``: a cell nobody waits for announces its end behind its queued lines (its view then has
    them all when it closes), and at once when nothing is left to write."""
    import threading

    from monarch_jupyter.kernel.output import OutputWriter

    record = CellOutput()
    ctx = contextvars.copy_context()
    ctx.run(OUTPUT_SINK.set, record.take)
    writer = OutputWriter()
    order: list[str] = []
    here: list[bool] = []
    writer.then(lambda: here.append(threading.current_thread() is threading.main_thread()))
    assert here == [True]  # nothing queued: called at once, on the caller's thread
    gate = threading.Event()

    class HeldStream(io.StringIO):  # the notebook's stdout, held: the writer's thread waits in its first write
        def write(self, text: str) -> int:
            gate.wait(30)
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", HeldStream())
    writer.put([(9, "stdout", "a line of no cell")], None)
    for i in range(3):
        writer.put([(0, "stdout", f"line {i}")], ctx)
    done = threading.Event()
    writer.then(lambda: (order.append(record.text()), done.set()))
    assert not done.is_set()  # behind the lines: they are not written yet
    gate.set()
    assert done.wait(30) and writer.flush(30)
    assert order == ["[rank0]: line 0\n[rank0]: line 1\n[rank0]: line 2"]
    assert sys.stdout.getvalue() == "[rank9]: a line of no cell\n"


def test_record_keeps_order_folds_updates_clears_and_bounds():
    record = CellOutput(lines_kept=5)
    record.take([(0, "stdout", "a"), (1, "stdout", "b"), ((0, 1), "stdout", "same"), (0, "stderr", "warn")])
    record.take([(0, "display", Rich(0, data={"text/plain": "[rank0]: v1"}, display_id="d"))])
    record.take([(0, "display", Rich(0, "update", {"text/plain": "[rank0]: v2"}, "d"))])
    assert record.text().splitlines() == ["[rank0]: a", "[rank1]: b", "[rank0,1]: same", "[rank0]: warn",
                                          "[rank0]: v2"]
    record.take([(1, "stdout", f"n{i}") for i in range(4)])  # 8 lines kept at most 5: the oldest go
    assert record.dropped == 3 and record.text().splitlines()[0].startswith("(3 earlier lines not kept: ")
    record.take([(1, "display", Rich(1, "clear"))])  # rank 1's own items go; rank 0's and folded lines stay
    _, items = record.items()
    assert [i.ranks for i in items] == [(0,), (0,)] and items[-1].kind == "display"
    assert record.ranks() == {0}


def test_items_html_labels_every_item_escapes_and_styles_stderr():
    record = CellOutput()
    record.take([(0, "stdout", "<b>not bold</b>"), (1, "stderr", "\x1b[31mred\x1b[0m warning"),
                 (0, "display", Rich(0, data={"text/plain": "[rank0]: <Figure>", "image/png": "QUJD"}))])
    _, items = record.items()
    page = render_items(items)
    assert "&lt;b&gt;not bold&lt;/b&gt;" in page and "<b>not bold" not in page
    assert 'class="mj-item mj-stderr" data-ranks=" 1 "' in page and "red warning" in page and "\x1b" not in page
    assert page.count('class="mj-who"') == 3 and page.count("<img") == 1  # a name on every item, figures too
    assert re.findall(r'class="mj-who"[^>]*>([^<]+)<', page) == ["rank 0", "rank 1", "rank 0"]
    failed = render_failure(1, "error", "ValueError: bad", "Traceback ...\nValueError: bad")
    assert "<details" in failed and "ValueError: bad" in failed
    assert "(Pdb rank 2)" in render_failure(2, "breakpoint", "")


def test_chart_axis_legend_scale_and_shared_lines():
    loss = [(float(x), 0.4 / (1 + 0.05 * x)) for x in range(1, 49)]
    spiky = [(0.0, 15.01), *loss]
    svg = render_charts({"loss": {0: spiky, 1: list(spiky), 2: [(x, y + 1) for x, y in loss]}})
    assert svg.count("<polyline") == 2  # ranks 0 and 1 are one curve: one line named for both
    assert "ranks 0,1" in svg and "rank 2" in svg and "first value off scale" in svg
    labels = re.findall(r'<text class="mj-axis"[^>]*>([^<]+)</text>', svg)
    assert labels[-1] == "48" and all(len(re.sub(r"\D", "", t).lstrip("0")) <= 3 for t in labels[:3]), labels
    assert "15" not in labels[2]  # the first value does not set the scale
    assert 'fill="currentColor"' in svg  # titles and labels take the theme's text colour
    pad = int(re.search(r'<rect x="(\d+)" y="20"', svg).group(1))
    assert pad >= 8 + 6 * max(len(t) for t in labels[:3])  # room for the longest y label


def test_running_step_counts_over_epochs_and_names_a_global_step():
    mon = model.MeshMonitor(_IdleMesh(1))
    mon.on_event("cell_started", {"cell_id": 1, "ranks": [0]})
    for epoch in range(3):  # a tqdm bar per epoch: n restarts at 0
        for n in range(0, 17, 4):
            mon.on_event("progress", {"rank": 0, "cell_id": 1, "n": n, "total": 16, "desc": f"epoch {epoch}",
                                      "postfix": f"loss={1 / (1 + n + 16 * epoch)}"})
        mon.on_event("progress", {"rank": 0, "cell_id": 1, "n": 2, "total": 4, "desc": "Validation",
                                  "postfix": "loss=9.0, val=0.5"})  # validation's steps are its own
    series = {name: per_rank[0] for name, per_rank in mon.metrics(1, [0]).items()}
    assert [x for x, _ in series["loss"]] == [float(x) for x in range(0, 49, 4)]
    assert series["val"] and all(y == 0.5 for _, y in series["val"])
    mon.on_event("cell_started", {"cell_id": 2, "ranks": [0]})
    for step in (10, 20):
        mon.on_event("progress", {"rank": 0, "cell_id": 2, "n": 1, "total": 2, "desc": "x",
                                  "postfix": f"global_step={step}, loss=1.0"})
    assert [x for x, _ in mon.metrics(2, [0])["loss"][0]] == [10.0, 20.0] and "global_step" not in mon.metrics(2, [0])


def test_a_cell_view_follows_the_next_cell_on_its_own_ranks_only() -> None:
    """Two fits on two sub-meshes start at once from two threads: each view was made for its sub-mesh's ranks and
    binds to the cell on those ranks, whichever of the two cells was submitted first."""
    from monarch_jupyter.widgets.view import LiveView

    view = LiveView(monitor=None, ranks=[0, 1], follow_cell=True)  # type: ignore[arg-type]  # never rendered here
    other, mine = object(), object()
    view._on_mesh_event("cell_started", {"cell_id": 7, "ranks": [2, 3], "handle": other})
    assert view.handle is None
    view._on_mesh_event("cell_started", {"cell_id": 8, "ranks": [0, 1], "handle": mine})
    assert (view.handle, view.cell_id, view.ranks) == (mine, 8, [0, 1])
    every = LiveView(monitor=None, ranks=None, follow_cell=True)  # type: ignore[arg-type]
    every._on_mesh_event("cell_started", {"cell_id": 9, "ranks": [3], "handle": other})
    assert every.handle is other


def test_a_debugger_note_ends_with_the_cell_even_with_no_running_event_between() -> None:
    """The visual debugger's note ("stopped at a breakpoint in the visual debugger ...") is the cell's until it
    resumes; a cell that ends ok shows no note, whether or not the resume reached the view before its result (the
    browser test saw the note left on a finished rank)."""

    mon = model.MeshMonitor(_IdleMesh(2))
    mon.on_event("cell_started", {"cell_id": 1, "ranks": [0, 1]})
    for rank in (0, 1):
        mon.on_event("rank_state", {"rank": rank, "state": "breakpoint", "note": "stopped at a breakpoint in the "
                                                                                 "visual debugger"})
    rows, _ = mon.snapshot(cell_id=1)
    assert [r.state for r in rows] == ["breakpoint", "breakpoint"] and "stopped at a breakpoint" in rows[0].error
    mon.on_event("rank_state", {"rank": 1, "state": "running"})
    for rank in (0, 1):  # rank 0's resume never reached the view: its result did
        mon.on_event("rank_result", {"rank": rank, "cell_id": 1, "status": "ok", "duration": 0.1})
    mon.on_event("rank_state", {"rank": 0, "state": "running"})  # the resume, after the result
    rows, _ = mon.snapshot(cell_id=1)
    assert [(r.state, r.error) for r in rows] == [("done", ""), ("done", "")]
    rows, _ = mon.snapshot()  # the mesh-level rows: both ranks idle, none left "running"
    assert [r.state for r in rows] == ["idle", "idle"]


def test_an_interrupted_rank_shows_interrupted_not_error() -> None:
    """An interrupt (the notebook's, %mesh interrupt, a timeout) is no error of the rank's code: the views said
    "error on ranks 0,1" for a cell the user stopped (helper-59). A rank that raised shows "error" still."""
    from monarch_jupyter.widgets.dashboard import render_table
    from monarch_jupyter.widgets.text import header_text

    mon = model.MeshMonitor(_IdleMesh(2))
    mon.on_event("cell_started", {"cell_id": 1, "ranks": [0, 1]})
    mon.on_event("rank_result", {"rank": 0, "cell_id": 1, "status": "error", "duration": 0.1, "interrupted": True,
                                 "ename": "KeyboardInterrupt", "evalue": ""})
    mon.on_event("rank_result", {"rank": 1, "cell_id": 1, "status": "error", "duration": 0.1,
                                 "ename": "ValueError", "evalue": "bad"})
    rows, summary = mon.snapshot(cell_id=1)
    assert [(r.state, r.error) for r in rows] == [("interrupted", "KeyboardInterrupt"), ("error", "ValueError: bad")]
    assert header_text(summary, times=False) == "ranks 0,1: error on rank 1 · interrupted on rank 0"
    assert summary.failed == (1,)  # counted among the failures: only the rank that raised
    table = render_table(rows)
    stopped_row = table.split('data-rank="0"')[1].split("</tr>")[0]
    assert 'data-state="interrupted"' in table and "mj-error" not in stopped_row  # grey, not red
    assert "color:rgba(0,0,0,.87)" in stopped_row  # dark text on the orange badge (helper-62: white was 2.2:1)
    stopped = render_failure(0, "interrupted", "KeyboardInterrupt", "Traceback ...\nKeyboardInterrupt")
    assert 'class="mj-note"' in stopped and "mj-error" not in stopped


def test_the_final_view_of_a_rank_done_before_its_result_reached_the_view_has_no_debugger_note() -> None:
    """At the end of a cell the handle is the authority (``LiveView._reconcile``): a rank that the handle says
    finished while the view still has it stopped at a breakpoint (its result event on its way) shows done and no
    note. The browser debugger test saw 'done' beside 'stopped at a breakpoint' in a CI run."""
    from monarch_jupyter.kernel.cells import CellSnapshot
    from monarch_jupyter.widgets.view import LiveView

    class Handle:
        def snapshot(self) -> CellSnapshot:
            return CellSnapshot({0, 1}, {}, {0: 0.5, 1: 8.7})

    mon = model.MeshMonitor(_IdleMesh(2))
    mon.on_event("cell_started", {"cell_id": 3, "ranks": [0, 1]})
    mon.on_event("rank_state", {"rank": 1, "state": "breakpoint", "note": "stopped at a breakpoint in the visual "
                                                                          "debugger"})
    mon.on_event("rank_result", {"rank": 0, "cell_id": 3, "status": "ok", "duration": 0.5})
    view = LiveView(mon, ranks=[0, 1], follow_cell=True)
    view._on_mesh_event("cell_started", {"cell_id": 3, "ranks": [0, 1], "handle": Handle()})
    rows, summary = view._reconcile(*view.snapshot())
    assert [(r.state, r.error, r.elapsed) for r in rows] == [("done", "", 0.5), ("done", "", 8.7)]


def test_runs_of_lines_are_recorded_and_written_as_their_lines_in_order(monkeypatch) -> None:
    """The router hands on the lines of a read as one run ((rank, stream, [lines]), records.Line): the record keeps
    them in order in items of at most RUN_LINES lines, and the streams get them labelled one per line, exactly as
    the same lines one by one."""
    from monarch_jupyter.widgets.record import RUN_LINES

    runs = [(0, "stdout", [f"a{i}" for i in range(450)]), (0, "stdout", ["b0", "b1"]), (1, "stderr", ["c0"]),
            (1, "stderr", "c1"), (0, "stdout", [f"d{i}" for i in range(RUN_LINES)])]
    single = [(rank, stream, t) for rank, stream, texts in runs for t in ([texts] if isinstance(texts, str) else texts)]
    a, b = CellOutput(), CellOutput()
    assert a.take(runs) and b.take(single)
    assert a.text() == b.text() and a.text().splitlines()[:2] == ["[rank0]: a0", "[rank0]: a1"]
    _, items = a.items()
    assert [len(i.lines) for i in items] == [RUN_LINES, RUN_LINES, 52, 2, RUN_LINES]
    assert [i.lines[0] for i in items] == ["a0", f"a{RUN_LINES}", f"a{2 * RUN_LINES}", "c0", "d0"]
    written = {}
    for name, batch in (("runs", runs), ("single", single)):
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        write_lines(batch)
        written[name] = (out.getvalue(), err.getvalue())
    assert written["runs"] == written["single"]
    assert written["runs"][1] == "[rank1]: c0\n[rank1]: c1\n"


def test_a_rank_a_scale_stopped_leaves_the_view_even_when_its_exit_comes_after_the_resize() -> None:
    """``%mesh scale -n 2`` from 3 ranks: the view drops rank 2 at the "resized" event; the stopped rank's exit
    (its "rank_state" dead, its output) may reach the view after it, and must not bring its row back (a fresh
    user's ``%mesh status`` showed "2 starting" for the rest of the session)."""
    mesh = _IdleMesh(3)
    mesh.state = SimpleNamespace(group_status=lambda: "up")  # type: ignore[attr-defined]
    mon = model.MeshMonitor(mesh)
    mesh.nproc = 2
    mon.on_event("resized", {"before": 3, "after": 2, "started": [], "stopped": [2]})
    mon.on_event("rank_state", {"rank": 2, "state": "dead", "returncode": -9})
    mon.on_event("output", {"rank": 2, "lines": ["a last line"], "cell_id": 1})
    rows, summary = mon.snapshot()
    assert [r.rank for r in rows] == [0, 1] and [r.state for r in rows] == ["idle", "idle"]
    mesh.nproc = 3  # and a rank a grow starts shows up from the "resized" event
    mon.on_event("resized", {"before": 2, "after": 3, "started": [2], "stopped": []})
    assert [r.rank for r in mon.snapshot()[0]] == [0, 1, 2]


def test_a_dead_rank_shows_no_memory() -> None:
    """Its last heartbeat's memory is not held by anything once it died (helper-59: '1  dead ... 164 MiB')."""
    mon = model.MeshMonitor(_IdleMesh(2))
    for r in (0, 1):
        mon.on_event("heartbeat", {"rank": r, "rss": 164 << 20, "cuda_allocated": 1 << 30, "cuda_reserved": 2 << 30})
    mon.on_event("rank_state", {"rank": 1, "state": "dead", "returncode": 3})
    rows, _ = mon.snapshot()
    assert [fmt_memory(row) for row in rows] == ["164 MiB · cuda 1.0 GiB/2.0 GiB", ""]
    assert table_text(rows)[2].split()[:2] == ["1", "dead"] and "exit code 3" in table_text(rows)[3]
