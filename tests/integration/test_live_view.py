"""Live per-rank view against a real 2-rank mesh: progress(), tqdm, failures, memory, dashboard, text, magics."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time

import pytest

from monarch_jupyter import Mesh, MeshError
from monarch_jupyter.widgets import cell_view, monitor_for, status_view
from monarch_jupyter.widgets.text import TextLiveView
from monarch_jupyter.widgets.view import TICKER

pytestmark = pytest.mark.timeout(120)

LOOP = """
import time
from monarch_worker import progress
for i in range({steps}):
    time.sleep({pause})
    progress(i + 1, {steps}, desc="train", loss=1.0 / (i + 1))
rank
"""

# Rank code that waits, after each step, for the test to open that step's gate (a file), so the test sees each
# step's report while the cell runs, however loaded the machine (never a race between sampling and the loop).
GATE = """
def gate(i):
    import os, time
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join({gates!r}, str(i))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {{i}} never opened")
        time.sleep(0.01)
"""
GATED_LOOP = GATE + """
from monarch_worker import progress
for i in range({steps}):
    progress(i + 1, {steps}, desc="train", loss=1.0 / (i + 1))
    gate(i)
rank
"""


def _open_gate(gates, i):
    (gates / str(i)).touch()


def _wait_for(sample, predicate, timeout=60.0):
    """Call ``sample()`` every 20 ms until ``predicate`` holds for its value; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = sample()
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout} s; last: {value!r}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(2, start_timeout=60)
    yield m
    m.stop()


def test_progress_reaches_the_monitor_while_the_cell_runs(mesh, tmp_path):
    monitor = monitor_for(mesh)
    handle = mesh.run(GATED_LOOP.format(steps=5, gates=str(tmp_path)), block=False)
    for i in range(5):
        rows = _wait_for(lambda: monitor.snapshot(handle.ranks, handle.cell_id)[0],
                         lambda rows, n=i + 1: all(r.n == n for r in rows))
        assert [(r.state, r.total, r.desc) for r in rows] == [("running", 5.0, "train")] * 2
        assert rows[0].postfix == f"loss={1.0 / (i + 1):.4g}"
        _open_gate(tmp_path, i)
    assert handle.result(30) == {0: 0, 1: 1}
    rows, summary = monitor.snapshot(handle.ranks, handle.cell_id)
    assert [(r.state, r.n, r.total, r.desc) for r in rows] == [("done", 5.0, 5.0, "train")] * 2
    assert rows[0].postfix == "loss=0.2"
    assert summary.finished and summary.by_state == {"done": (0, 1)}


@pytest.mark.parametrize("module", ["tqdm", "tqdm.auto"])
def test_tqdm_bar_drives_the_rank_progress(mesh, module, tmp_path):
    """Each step's count and postfix show while the step runs. set_postfix redraws the bar right after the step
    count, within the throttle interval: that report is held back, and must still go out during the step."""
    monitor = monitor_for(mesh)
    code = GATE.format(gates=str(tmp_path)) + f"""
from {module} import tqdm
bar = tqdm(range(4), desc="batches", mininterval=0)
for i in bar:
    bar.set_postfix(step=i)
    gate(i)
"""
    handle = mesh.run(code, ranks=[0], block=False)
    for i in range(4):
        row = _wait_for(lambda: monitor.snapshot([0], handle.cell_id)[0][0],
                        lambda row, i=i: (row.n, row.postfix) == (i, f"step={i}"))
        assert (row.state, row.desc, row.total) == ("running", "batches", 4)
        _open_gate(tmp_path, i)
    handle.result(30)
    final = monitor.snapshot([0], handle.cell_id)[0][0]
    assert (final.state, final.n, final.total, final.postfix) == ("done", 4.0, 4.0, "step=3")


def test_nested_tqdm_reports_inner_bar_with_outer_count(mesh, tmp_path):
    monitor = monitor_for(mesh)
    code = GATE.format(gates=str(tmp_path)) + """
from tqdm import trange
for epoch in trange(2, desc="epoch"):
    for b in trange(3, desc="batch", mininterval=0):
        gate(f"{epoch}-{b}")
"""
    handle = mesh.run(code, ranks=[0], block=False)
    for epoch in range(2):
        for b in range(3):
            _wait_for(lambda: monitor.snapshot([0], handle.cell_id)[0][0],
                      lambda row, e=epoch, b=b: (row.desc, row.n) == (f"epoch {e}/2 · batch", b))
            _open_gate(tmp_path, f"{epoch}-{b}")
    handle.result(30)


def test_failures_show_in_the_row_at_once(mesh):
    """Rank 1 raises at once; the row says so while rank 0 still runs."""
    monitor = monitor_for(mesh)
    code = """
import time
if rank == 1:
    raise ValueError("bad batch 7")
time.sleep(3)
"""
    handle = mesh.run(code, block=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = {r.rank: r for r in monitor.snapshot(handle.ranks, handle.cell_id)[0]}
        if rows[1].state == "error":
            break
        time.sleep(0.02)
    assert not handle.done()
    assert rows[0].state == "running"
    assert (rows[1].state, rows[1].error) == ("error", "ValueError: bad batch 7")
    with pytest.raises(MeshError):
        handle.result(30)


def test_heartbeat_memory(mesh):
    monitor = monitor_for(mesh)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rows, _ = monitor.snapshot()
        if all(r.rss > 0 for r in rows):
            break
        time.sleep(0.1)
    assert all(r.rss > 10 * 2**20 for r in rows), rows  # a rank with torch imported holds well over 10 MiB
    assert all(r.cuda_allocated == r.cuda_reserved == 0 for r in rows)  # CPU ranks never touch CUDA
    assert mesh.status()[0]["rss"] > 0


def test_dashboard_widget_updates_live_and_keeps_final_state(mesh, tmp_path):
    view = cell_view(mesh, [0, 1], mode="widget", defer=0)
    try:
        handle = mesh.run(GATED_LOOP.format(steps=4, gates=str(tmp_path)), block=False)
        assert view.handle is handle
        for i in range(4):
            _wait_for(lambda: view.widget.html.value,
                      lambda html, n=i + 1: html.count(f'data-state="running" data-n="{n}"') == 2)
            _open_gate(tmp_path, i)
        handle.result(30)
        view.finish()
    finally:
        view.finish()
    final = view.widget.html.value
    assert 'data-final="true"' in final
    assert re.findall(r'data-rank="(\d)" data-state="(\w+)" data-n="(\d+)"', final) == [("0", "done", "4"),
                                                                                      ("1", "done", "4")]
    assert view not in TICKER.live_views()
    # The final state stays: a later cell does not touch this view.
    mesh.run("1")
    assert view.widget.html.value == final
    bundle = view.widget._repr_mimebundle_()
    assert bundle["text/plain"] == "mesh cell on ranks 0,1"


def test_status_view_text_plain_is_stable(mesh):
    widget = status_view(mesh, mode="widget")
    assert widget._repr_mimebundle_()["text/plain"] == "mesh: ranks 0,1: idle on ranks 0,1\n  ranks 0,1: idle (cpu)"
    text = status_view(mesh, mode="text")
    assert re.search(r"^\s+0\s+idle\s+cpu", repr(text), re.M), repr(text)


def test_text_view_prints_progress_and_failure(mesh):
    out = io.StringIO()
    view = TextLiveView(monitor_for(mesh), [0, 1], follow_cell=True, interval=0.3, quiet=0.2, stream=out).start()
    code = LOOP.format(steps=8, pause=0.15).replace("rank\n", "") + "if rank == 1: raise KeyError('missing')\n"
    with pytest.raises(MeshError):
        mesh.run(code)
    view.finish()
    text = out.getvalue()
    assert re.search(r"\[mesh [\d.]+ s\] ranks 0,1: running on ranks 0,1 · rank 0 \d/8 · train", text), text
    assert "[mesh] rank 1 error: KeyError: 'missing'" in text
    assert text.rstrip().splitlines()[-1].startswith("[mesh] ranks 0,1: error on rank 1 · done on rank 0")


def test_text_view_speaks_only_when_it_has_something_to_say(mesh):
    """Ranks that print keep the text view quiet (no clock-only lines between their lines); a silent cell gets a
    line saying so, then lines at growing gaps."""
    out = io.StringIO()
    view = TextLiveView(monitor_for(mesh), [0, 1], interval=0.2, quiet=0.1, silence=5.0, stream=out).start()
    mesh.run("import time\nfor i in range(12):\n    print('step', i, flush=True)\n    time.sleep(0.2)\n")
    view.finish()
    assert out.getvalue() == "", out.getvalue()

    out = io.StringIO()
    view = TextLiveView(monitor_for(mesh), [0, 1], interval=0.2, quiet=0.1, silence=0.6, stream=out).start()
    handle = mesh.run("import time\ntime.sleep(60)\n", block=False)
    deadline = time.monotonic() + 60
    while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:  # the first two "no output" lines
        time.sleep(0.05)
    mesh.interrupt()
    with pytest.raises(KeyboardInterrupt):
        handle.result(30)
    view.finish()
    lines = out.getvalue().splitlines()
    assert [re.sub(r"[\d.]+ s\]", "T]", line) for line in lines[:2]] == [
        "[mesh T] ranks 0,1: running on ranks 0,1 · no output yet"] * 2, lines
    times = [float(re.match(r"\[mesh ([\d.]+) s\]", line).group(1)) for line in lines[:2]]
    assert times[1] - times[0] >= 1.1, times  # the second after twice the silence (1.2 s; clock shown to 0.1 s)


def test_text_view_of_a_cell_that_waits_behind_another_shows_no_clock(mesh, tmp_path):
    go = tmp_path / "go"
    monitor_for(mesh)  # it sees the first cell start (in a notebook it watches the mesh from its start)
    first = mesh.run(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n",
                     block=False)
    out = io.StringIO()
    view = TextLiveView(monitor_for(mesh), [0, 1], interval=0.2, quiet=0.1, silence=0.3, stream=out).start()
    second = mesh.run("'second'", ranks=[0, 1], block=False)
    deadline = time.monotonic() + 60
    while "\n" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    first.result(60)
    assert second.result(60) == {0: "second", 1: "second"}
    view.finish()
    assert out.getvalue().splitlines()[0] == "[mesh] ranks 0,1: queued on ranks 0,1", out.getvalue()  # no "[mesh ]"


def test_breakpoint_state_from_the_debugger_event(mesh):
    """The debugger reports a rank stopped at a breakpoint as a rank_state event; the row shows it."""
    monitor = monitor_for(mesh)
    handle = mesh.run("import time; time.sleep(1.5)", block=False)
    mesh.events.emit("rank_state", rank=1, state="breakpoint")
    mesh.events.flush()
    rows = monitor.snapshot(handle.ranks, handle.cell_id)[0]
    assert [r.state for r in rows] == ["running", "breakpoint"]
    mesh.events.emit("rank_state", rank=1, state="running")
    mesh.events.flush()
    handle.result(30)
    assert [r.state for r in monitor.snapshot(handle.ranks, handle.cell_id)[0]] == ["done", "done"]


def test_magics_widget_no_widget_and_async(mesh):
    from IPython.core.interactiveshell import InteractiveShell

    from monarch_jupyter.kernel import registry
    from monarch_jupyter.magics import _MAGICS, load

    shell = InteractiveShell.instance()
    load(shell)
    saved = registry.peek_current()
    registry.set_current(mesh)  # %%mesh runs on the current mesh
    try:
        magics = shell.magics_manager.registry["MeshMagics"]
        magics.live_view = "widget"
        before = len(TICKER.live_views())
        assert shell.run_cell_magic("mesh", "--no-widget", "rank + 1") == {0: 1, 1: 2}
        assert len(TICKER.live_views()) == before
        handle = shell.run_cell_magic("mesh", "--async", LOOP.format(steps=6, pause=0.2))
        assert not handle.done()
        views = [v for v in TICKER.live_views() if v.handle is handle]
        assert len(views) == 1  # the view of the async cell is still live after the magic returned
        view = views[0]
        assert handle.wait(30)
        assert handle.result() == {0: 0, 1: 1}
        deadline = time.monotonic() + 5
        while not view.final and time.monotonic() < deadline:
            time.sleep(0.05)
        assert view.final and 'data-state="done" data-n="6"' in view.widget.html.value
        with pytest.raises(Exception, match="--async returns a CellHandle"):
            shell.run_cell_magic("mesh", "--async --out x", "1")
    finally:
        # Not unload(): it would stop the fixture's mesh and the fork server the other tests share.
        _MAGICS.pop(id(shell), None)
        InteractiveShell.clear_instance()
        registry.set_current(saved)


def test_syntax_error_leaves_no_live_view(mesh):
    before = len(TICKER.live_views())
    view = cell_view(mesh, mode="text")
    with pytest.raises(SyntaxError):
        mesh.run("def (:")
    view.finish()
    assert view.final and len(TICKER.live_views()) == before


def test_dead_rank_shows_signal_name(mesh):
    """Runs last in this module: it kills rank 1 and restarts the mesh."""
    monitor = monitor_for(mesh)
    code = """
import os, signal, time
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(2)
"""
    handle = mesh.run(code, block=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = {r.rank: r for r in monitor.snapshot(handle.ranks, handle.cell_id)[0]}
        if rows[1].state == "dead":
            break
        time.sleep(0.02)
    assert (rows[1].state, rows[1].error) == ("dead", "signal SIGKILL")
    assert rows[0].state in ("running", "error")  # the survivor is interrupted as rank 1 died: part of that failure
    with pytest.raises(MeshError):
        handle.result(30)
    mesh.restart()
    rows, _ = monitor.snapshot()
    assert [r.state for r in rows] == ["idle", "idle"]


def test_worker_imports_no_notebook_packages():
    code = ("import sys, monarch_worker, monarch_worker.runtime, monarch_worker.live\n"
            "bad = [m for m in ('IPython', 'ipywidgets', 'monarch_jupyter', 'tqdm') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_interrupt_that_lands_while_a_rank_writes_a_progress_report_stops_the_cell(mesh, tmp_path, caplog):
    """A rank writes each report into its stdout pipe (a record) from the cell's own thread. An interrupt that lands
    during that write is held until the report is whole, then stops the cell: it was swallowed before (the cell ran
    on, stuck after the grace, in 10 of 10 tries), or the report went out twice ('dropped a record ... replayed').
    Big reports (60 kB, 15 pipe writes each) sent back to back make the write where the interrupt lands."""
    started = tmp_path / "started"
    code = ("import pathlib\nfrom monarch_worker import progress\ni = 0\nwhile True:\n    i += 1\n"
            "    progress(i, i, desc='d' * 60000)  # n == total: sent at once, never held back by throttling\n"
            f"    pathlib.Path({str(started)!r} + str(rank)).touch()\n")
    for attempt in range(3):
        for r in (0, 1):
            (tmp_path / f"started{r}").unlink(missing_ok=True)
        handle = mesh.run(code, block=False)
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        report = mesh.interrupt(grace=20)
        try:
            assert report.interrupted == [0, 1] and not report.stuck, (attempt, report.text)
            with pytest.raises(KeyboardInterrupt):
                handle.result(30)
        finally:
            if report.stuck:
                mesh.interrupt(force=True)
    assert mesh.run("rank") == {0: 0, 1: 1}
    assert "dropped a record" not in caplog.text, caplog.text
