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


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(2, start_timeout=60)
    yield m
    m.stop()


def _sample_while_running(handle, sample, timeout=30.0):
    """Call ``sample()`` every 50 ms until ``handle`` is done; returns the samples taken while it ran."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = sample()
        if handle.done():
            return seen
        seen.append(value)
        time.sleep(0.05)
    raise AssertionError("cell did not finish")


def test_progress_reaches_the_monitor_while_the_cell_runs(mesh):
    monitor = monitor_for(mesh)
    handle = mesh.run(LOOP.format(steps=10, pause=0.15), block=False)
    seen = _sample_while_running(handle, lambda: monitor.snapshot(handle.ranks, handle.cell_id)[0])
    assert handle.result(30) == {0: 0, 1: 1}
    running_counts = {row.n for rows in seen for row in rows if row.state == "running" and row.n is not None}
    assert len(running_counts & {2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}) >= 3, running_counts
    rows, summary = monitor.snapshot(handle.ranks, handle.cell_id)
    assert [(r.state, r.n, r.total, r.desc) for r in rows] == [("done", 10.0, 10.0, "train")] * 2
    assert rows[0].postfix == "loss=0.1"
    assert summary.finished and summary.by_state == {"done": (0, 1)}


@pytest.mark.parametrize("module", ["tqdm", "tqdm.auto"])
def test_tqdm_bar_drives_the_rank_progress(mesh, module):
    monitor = monitor_for(mesh)
    code = f"""
import time
from {module} import tqdm
bar = tqdm(range(12), desc="batches")
for i in bar:
    time.sleep(0.12)
    bar.set_postfix(step=i)
"""
    handle = mesh.run(code, block=False)
    seen = _sample_while_running(handle, lambda: monitor.snapshot([0], handle.cell_id)[0][0])
    handle.result(30)
    mid = {row.n for row in seen if row.n is not None and 0 < row.n < 12}
    assert len(mid) >= 3, [(r.state, r.n) for r in seen]
    assert all(row.desc == "batches" and row.total == 12 for row in seen if row.n is not None)
    final = monitor.snapshot([0], handle.cell_id)[0][0]
    assert (final.state, final.n, final.total) == ("done", 12.0, 12.0)
    assert final.postfix.startswith("step=")


def test_nested_tqdm_reports_inner_bar_with_outer_count(mesh):
    monitor = monitor_for(mesh)
    code = """
import time
from tqdm import trange
for epoch in trange(2, desc="epoch"):
    for b in trange(5, desc="batch"):
        time.sleep(0.1)
"""
    handle = mesh.run(code, ranks=[0], block=False)
    seen = _sample_while_running(handle, lambda: monitor.snapshot([0], handle.cell_id)[0][0])
    handle.result(30)
    descs = {row.desc for row in seen if row.n is not None}
    assert any(d.startswith(("epoch 0/2 · batch", "epoch 1/2 · batch")) for d in descs), descs


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


def test_dashboard_widget_updates_live_and_keeps_final_state(mesh):
    view = cell_view(mesh, [0, 1], mode="widget", defer=0)
    try:
        handle = mesh.run(LOOP.format(steps=8, pause=0.2), block=False)
        assert view.handle is handle
        seen = _sample_while_running(handle, lambda: view.widget.html.value)
        handle.result(30)
        view.finish()
    finally:
        view.finish()
    counts = {int(n) for html in seen for n in re.findall(r'data-state="running" data-n="(\d+)"', html)}
    assert len(counts & set(range(1, 8))) >= 3, counts
    final = view.widget.html.value
    assert 'data-final="true"' in final
    assert re.findall(r'data-rank="(\d)" data-state="(\w+)" data-n="(\d+)"', final) == [("0", "done", "8"),
                                                                                      ("1", "done", "8")]
    assert view not in TICKER.live_views()
    # The final state stays: a later cell does not touch this view.
    mesh.run("1")
    assert view.widget.html.value == final
    bundle = view.widget._repr_mimebundle_()
    assert bundle["text/plain"] == "mesh cell on ranks 0,1 (live per-rank view)"


def test_status_view_text_plain_is_stable(mesh):
    widget = status_view(mesh, mode="widget")
    assert widget._repr_mimebundle_()["text/plain"] == "mesh: ranks 0,1: idle 0,1\n  ranks 0,1: idle (cpu)"
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
    assert re.search(r"\[mesh [\d.]+ s\] ranks 0,1: running 0,1 · rank 0 \d/8 · train", text), text
    assert "[mesh] rank 1 error: KeyError: 'missing'" in text
    assert text.rstrip().splitlines()[-1].startswith("[mesh] ranks 0,1: error 1 · done 0")


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
    assert rows[0].state in ("running", "error")  # the survivor is interrupted as rank 1 died (recovery.py)
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
