"""The live dashboard through a real Jupyter kernel (jupyter_client): what a frontend receives on IOPub."""

from __future__ import annotations

import queue
import re
import time

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(180)]

jupyter_client = pytest.importorskip("jupyter_client")

LOOP = """%%mesh
import time
from monarch_worker import progress
for i in range(8):
    time.sleep(0.2)
    progress(i + 1, 8, desc="train")
"""


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        yield kc
    finally:
        try:
            execute(kc, "%mesh stop", timeout=30)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)


def execute(kc, code: str, timeout: float = 60.0) -> list[dict]:
    """Run ``code``; IOPub messages of that execution until the kernel is idle again (errors raise)."""
    # stop_on_error=False: a cell of its own, not aborted after an earlier error (test_kernel.execute)
    msg_id = kc.execute(code, stop_on_error=False)
    msgs = []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        msgs.append(msg)
        if msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return msgs


def html_updates(msgs: list[dict]) -> list[str]:
    return [m["content"]["data"]["state"]["value"] for m in msgs if m["msg_type"] == "comm_msg"
            and "mj-dashboard" in str(m["content"]["data"].get("state", {}).get("value", ""))]


def test_dashboard_streams_progress_and_ends_done(kernel):
    execute(kernel, "%load_ext monarch")
    execute(kernel, "%mesh start -n 2")
    msgs = execute(kernel, LOOP)
    shown = [m for m in msgs if m["msg_type"] == "display_data"]
    assert len(shown) == 1
    data = shown[0]["content"]["data"]
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == "mesh cell on ranks 0,1 (live per-rank view)"
    updates = html_updates(msgs)
    running = {int(n) for u in updates for n in re.findall(r'data-state="running" data-n="(\d+)"', u)}
    assert len(running & set(range(1, 8))) >= 3, running  # live: several intermediate counts while it ran
    final = updates[-1]
    assert 'data-final="true"' in final  # the final state is sent before the cell ends
    assert re.findall(r'data-rank="(\d)" data-state="(\w+)" data-n="(\d+)"', final) == [("0", "done", "8"),
                                                                                      ("1", "done", "8")]
    assert not [m for m in msgs if m["msg_type"] == "clear_output"]
    # One update, of the same display, at the end: its static form for frontends without widgets, final.
    (update,) = [m for m in msgs if m["msg_type"] == "update_display_data"]
    assert update["content"]["transient"] == shown[0]["content"]["transient"]
    assert 'data-final="true"' in update["content"]["data"]["text/html"]


def test_fast_cell_gets_one_static_display_and_no_widget(kernel):
    """A cell that ends before the widget is due: one display_data at its end (final table as HTML, each rank's
    output in a <details>), no comm at all; its text/plain is the same stable text as a live dashboard's. The
    widget is made due in 120 s here, so that the cell ends first however loaded the machine is."""
    execute(kernel, "import monarch_jupyter.widgets.celldash as _cd; _defer, _cd.DEFER = _cd.DEFER, 120.0")
    try:
        msgs = execute(kernel, "%%mesh\nprint('hello from', rank)")
    finally:
        execute(kernel, "_cd.DEFER = _defer")
    assert not [m for m in msgs if m["msg_type"].startswith("comm")]
    (shown,) = [m for m in msgs if m["msg_type"] in ("display_data", "update_display_data")]
    data = shown["content"]["data"]
    assert shown["msg_type"] == "display_data"
    assert data["text/plain"] == "mesh cell on ranks 0,1 (live per-rank view)"
    page = data["text/html"]
    assert 'data-final="true"' in page and page.startswith("<style>\n.mj-dashboard ")
    assert re.findall(r'data-rank="(\d)" data-state="(\w+)"', page) == [("0", "done"), ("1", "done")]
    for r in (0, 1):
        assert re.search(rf'<details class="mj-rank-details" data-rank="{r}">.*hello from {r}', page, re.S)


def test_no_output_line_lost_with_the_dashboard_on(kernel):
    msgs = execute(kernel, "%%mesh --order rank\nfor i in range(3000):\n    print(f'line {i}')\n")
    text = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    for r in (0, 1):
        got = re.findall(rf"^\[rank{r}\]: line (\d+)$", text, re.M)
        assert got == [str(i) for i in range(3000)]


def test_async_cell_keeps_updating_after_it_returns(kernel):
    msgs = execute(kernel, LOOP.replace("%%mesh", "%%mesh --async"))
    result = [m for m in msgs if m["msg_type"] == "execute_result"]
    assert "running" in result[0]["content"]["data"]["text/plain"]
    assert not any('data-final="true"' in u for u in html_updates(msgs))
    later: list[dict] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            later.append(kernel.get_iopub_msg(timeout=1))
        except queue.Empty:
            continue
        updates = html_updates(later)
        if updates and 'data-final="true"' in updates[-1]:
            break
    updates = html_updates(later)
    assert len(updates) >= 2, "no widget updates after the async cell returned"
    assert 'data-state="done" data-n="8"' in updates[-1] and 'data-final="true"' in updates[-1]
    execute(kernel, "h = _\nassert h.done() and h.result() is None")
