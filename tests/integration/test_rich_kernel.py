"""Rich output, rich results, completion, inspection and auto mode through a real Jupyter kernel (jupyter_client):
every message type a frontend receives from ranks, and the bad inputs of issue 13."""

from __future__ import annotations

import base64
import hashlib
import re
import time

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(300)]

jupyter_client = pytest.importorskip("jupyter_client")
HAS_MPL = True
try:
    import matplotlib  # noqa: F401
except ImportError:
    HAS_MPL = False
needs_mpl = pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed (pip install '.[plots]')")


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        # No live view: these tests read the messages the kernel sends for the ranks' displays (a cell's view takes
        # them in; test_live_kernel.py checks that path).
        execute(kc, "%load_ext monarch\n%config MeshMagics.stream_order = 'rank'\n%config MeshMagics.live_view = 'off'")
        execute(kc, "%mesh start -n 2")
        yield kc
    finally:
        try:
            execute(kc, "%mesh stop", timeout=30)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)


def execute(kc, code: str, timeout: float = 120.0, errors: bool = True) -> list[dict]:
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
        if errors and msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return msgs


def rank_displays(msgs: list[dict], kind: str = "display_data") -> dict[int, list[dict]]:
    """rank -> contents of the displays of that kind that ranks sent (labelled in metadata)."""
    out: dict[int, list[dict]] = {}
    for m in msgs:
        if m["msg_type"] == kind and "monarch_jupyter" in m["content"].get("metadata", {}):
            out.setdefault(m["content"]["metadata"]["monarch_jupyter"]["rank"], []).append(m["content"])
    return out


def stderr_text(msgs: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream" and m["content"]["name"] ==
                   "stderr")


def test_display_types_reach_the_cell_labelled_by_rank(kernel):
    msgs = execute(kernel, """%%mesh
from IPython.display import HTML, Markdown, JSON, SVG, Latex, Image, display
class Rich:
    def _repr_html_(self):
        return f"<i>rich {rank}</i>"
class Bundle:
    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/markdown": f"**bundle {rank}**", "text/plain": "bundle"}
class Png:
    def _repr_png_(self):
        return bytes(range(256)) * 4
display(HTML(f"<b>html {rank}</b>"))
display(Markdown(f"# md {rank}"), JSON({"rank": rank}), SVG('<svg xmlns="http://www.w3.org/2000/svg"/>'))
display(Latex(r"$x_%d$" % rank))
display(Rich(), Bundle(), Png())
display(Image(data=bytes(range(256)), format="png"))
""")
    shown = rank_displays(msgs)
    assert sorted(shown) == [0, 1]
    for r, items in shown.items():
        assert len(items) == 9
        html, md, js, svg, latex, rich, bundle, png, image = (c["data"] for c in items)
        assert html["text/html"] == f"<b>html {r}</b>" and html["text/plain"].startswith(f"[rank{r}]: ")
        assert md["text/markdown"] == f"# md {r}"
        assert js["application/json"] == {"rank": r}
        assert svg["image/svg+xml"].startswith("<svg")
        assert latex["text/latex"] == f"$x_{r}$"
        assert rich["text/html"] == f"<i>rich {r}</i>"
        assert bundle["text/markdown"] == f"**bundle {r}**" and bundle["text/plain"] == f"[rank{r}]: bundle"
        assert base64.b64decode(png["image/png"]) == bytes(range(256)) * 4
        assert base64.b64decode(image["image/png"]) == bytes(range(256))


def test_update_display_and_clear_output(kernel):
    msgs = execute(kernel, """%%mesh
from IPython.display import display, update_display, clear_output
h = display("start", display_id=True)
h.update(f"updated {rank}")
display("named", display_id="progress")
update_display(f"named {rank}", display_id="progress")
clear_output(wait=True)
""")
    shown, updates = rank_displays(msgs), rank_displays(msgs, "update_display_data")
    for r in (0, 1):
        ids = [c["transient"]["display_id"] for c in shown[r]]
        assert all(i.startswith(f"mj-rank{r}-") for i in ids)  # ids are per rank
        assert [c["transient"]["display_id"] for c in updates[r]] == ids
        assert [c["data"]["text/plain"] for c in updates[r]] == [f"[rank{r}]: 'updated {r}'",
                                                                 f"[rank{r}]: 'named {r}'"]
    clears = [m for m in msgs if m["msg_type"] == "clear_output"]
    assert len(clears) == 2 and all(m["content"]["wait"] for m in clears)


def _ipykernel_major() -> int:
    from importlib.metadata import version

    return int(version("ipykernel").split(".")[0])


@pytest.mark.skipif(_ipykernel_major() < 7, reason="ipykernel 6 keeps one parent message for the whole kernel, "
                    "not one per context (docs/live_view.md)")
def test_display_that_arrives_late_goes_to_its_cell(kernel):
    """A rank thread displays 1 s after its --async cell returned, while another cell runs: the display carries
    the first cell's parent header, so the frontend shows it there."""
    first = kernel.execute("""%%mesh --async
import threading, time
from IPython.display import HTML, display
def later():
    time.sleep(1.0)
    display(HTML(f"<b>late {rank}</b>"))
threading.Thread(target=later).start()
""")
    second = kernel.execute("import time; time.sleep(2.5)")
    late, idle = [], False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (idle and len(late) == 2):
        try:
            m = kernel.get_iopub_msg(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
            continue
        if m["msg_type"] == "display_data" and "late" in m["content"]["data"].get("text/html", ""):
            late.append(m)
        if (m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                and m["parent_header"].get("msg_id") == second):
            idle = True
    assert sorted(m["content"]["data"]["text/html"] for m in late) == ["<b>late 0</b>", "<b>late 1</b>"]
    assert {m["parent_header"]["msg_id"] for m in late} == {first}


@needs_mpl
def test_matplotlib_figures_show_once_per_rank_and_are_closed(kernel):
    msgs = execute(kernel, """%%mesh
import matplotlib.pyplot as plt
plt.plot([0, 1, rank + 2])
plt.title(f"rank {rank}")
""")
    shown = rank_displays(msgs)
    for r in (0, 1):
        (fig,) = shown[r]
        assert base64.b64decode(fig["data"]["image/png"]).startswith(b"\x89PNG")
        assert fig["data"]["text/plain"] == f"[rank{r}]: <Figure size 640x480 with 1 Axes>"
    msgs = execute(kernel, "%%mesh\nplt.get_fignums()")
    result = [m for m in msgs if m["msg_type"] == "execute_result"][0]
    assert result["content"]["data"]["text/plain"] == "{0: [], 1: []}"  # closed after display
    msgs = execute(kernel, """%%mesh --ranks 0
plt.plot([1, 2]); plt.show()
print("after show", len(plt.get_fignums()))
plt.figure(); plt.plot([3, 4])
""")
    shown = rank_displays(msgs)
    assert list(shown) == [0] and len(shown[0]) == 2  # plt.show(), then the figure left at the end
    assert "[rank0]: after show 0" in "".join(m["content"].get("text", "") for m in msgs)


@needs_mpl
def test_figure_value_and_rich_results_render_per_rank(kernel):
    msgs = execute(kernel, """%%mesh
import threading
fig = plt.figure(); plt.plot([1, 2])
fig.lock = threading.Lock()  # unpicklable
fig""")
    (result,) = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result["text/plain"] == "{0: <Figure size 640x480 with 1 Axes>, 1: <Figure size 640x480 with 1 Axes>}"
    assert result["text/html"].count("<img src=\"data:image/png;base64,") in (1, 2)
    assert not rank_displays(msgs)  # the value is the figure's one showing
    msgs = execute(kernel, """%%mesh
class Table:
    def __init__(self, v): self.v = v
    def _repr_html_(self): return f"<table><tr><td>{self.v}</td></tr></table>"
    def __repr__(self): return f"Table({self.v})"
    def __eq__(self, other): return getattr(other, "v", None) == self.v  # each rank's Table is its own class
Table(rank)""")
    (result,) = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result["text/plain"] == "{0: Table(0), 1: Table(1)}"
    assert re.findall(r'class="mj-rankmap-rank" data-rank="(\d)"', result["text/html"]) == ["0", "1"]
    msgs = execute(kernel, "%%mesh\nTable(7)")
    (result,) = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert "all 2 ranks equal" in result["text/html"] and result["text/html"].count("<td>7</td>") == 1
    msgs = execute(kernel, "%%mesh\nrank * 3")
    (result,) = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result == {"text/plain": "{0: 0, 1: 3}"}  # plain values: text only, as before


def test_large_image_travels_intact_through_shared_memory(kernel):
    msgs = execute(kernel, """%%mesh
import hashlib, os
class Big:
    data = os.urandom(3 * 2**20)
    def _repr_png_(self):
        return self.data
big = Big()
display(big)
hashlib.sha256(big.data).hexdigest()""")
    (result,) = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    digests = dict(re.findall(r"(\d): '([0-9a-f]{64})'", result))
    for r, items in rank_displays(msgs).items():
        data = base64.b64decode(items[0]["data"]["image/png"])
        assert len(data) == 3 * 2**20 and hashlib.sha256(data).hexdigest() == digests[str(r)]
    execute(kernel, "%%mesh\nfrom monarch_worker.transfer import pool_stats\nimport time\ntime.sleep(0.5)")
    msgs = execute(kernel, "%%mesh\npool_stats()['lent']")
    (result,) = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result == "{0: 0, 1: 0}"  # the notebook released the segments


def test_bad_displays_end_with_a_clear_message(kernel):
    msgs = execute(kernel, """%%mesh
class Broken:
    def _repr_html_(self):
        raise ValueError("no html")
    def __repr__(self):
        raise RuntimeError("no repr")
display(Broken())
class Huge:
    def _repr_png_(self):
        return b"x" * (50 * 2**20)
display(Huge())
for i in range(10_000):
    display(i)
print("still here")
""", timeout=240)
    err = stderr_text(msgs)
    assert "_repr_html_ of Broken raised ValueError: no html" in err
    assert "repr() of Broken raised RuntimeError: no repr" in err
    assert "was not sent: the limit is" in err
    shown = rank_displays(msgs)
    if any(len(shown.get(r, [])) != 1000 + 1 for r in (0, 1)):  # say what is missing, and whether it came late
        late = rank_displays(_late_messages(kernel, msgs[0]["parent_header"]["msg_id"]))
        pytest.fail(f"displays per rank: {({r: len(v) for r, v in shown.items()})}, missing: "
                    f"{({r: _missing_numbers(v) for r, v in shown.items()})}; after the kernel was idle: "
                    f"{({r: [c['data']['text/plain'] for c in v][:30] for r, v in late.items()})}")
    for r in (0, 1):
        texts = [c["data"]["text/plain"] for c in shown[r]]
        assert texts[0] == f"[rank{r}]: <Broken object (its repr raised RuntimeError)>"
        assert "limit" in texts[1] and "image/png" not in shown[r][1]["data"]
        assert len(shown[r]) == 1000 + 1  # the cap per rank and cell, then one note
        assert "more displays of this cell were not shown" in texts[-1]
    execute(kernel, "%%mesh\nassert 1 + 1 == 2")  # the mesh is still usable


def _late_messages(kc, msg_id: str, quiet: float = 5.0) -> list[dict]:
    """IOPub messages of request ``msg_id`` that come after its idle status (none should), until ``quiet`` s pass
    without one."""
    import queue

    late = []
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=quiet)
        except queue.Empty:
            return late
        if msg["parent_header"].get("msg_id") == msg_id:
            late.append(msg)


def _missing_numbers(contents: list[dict]) -> list[int]:
    """Which of display(0) .. display(997) (the cap less the two displays before them) did not come."""
    seen = {int(t.split(": ", 1)[1]) for c in contents if (t := c["data"].get("text/plain", "")).split(": ", 1)[-1]
            .isdigit()}
    return sorted(set(range(998)) - seen)


def shell_reply(kc, msg_id: str) -> dict:
    """The content of the shell reply to ``msg_id`` (earlier execute replies are skipped)."""
    while True:
        reply = kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def complete(kc, code: str, cursor: int | None = None) -> dict:
    return shell_reply(kc, kc.complete(code, len(code) if cursor is None else cursor))


def test_completion_and_inspection_from_rank_zero(kernel):
    execute(kernel, "%%mesh\nrank_only_name = 42\ndef rank_fn(a, b=2):\n    'Adds on the rank.'\n    return a + b")
    reply = complete(kernel, "%%mesh\nx = rank_only")
    assert "rank_only_name" in reply["matches"]
    reply = complete(kernel, "x = rank_only")  # not a mesh cell: the kernel has no such name
    assert "rank_only_name" not in reply["matches"]
    content = shell_reply(kernel, kernel.inspect("%%mesh\nrank_fn(", len("%%mesh\nrank_fn(")))
    assert content["found"] and "Adds on the rank." in content["data"]["text/plain"]
    assert "rank_fn(a, b=2)" in content["data"]["text/plain"]
    # While the ranks are busy in a cell: answered by the rank's I/O thread.
    execute(kernel, "%%mesh --async\nimport time\ntime.sleep(600)")
    execute(kernel, "busy = _")
    reply = complete(kernel, "%%mesh\nrank_only")
    assert "rank_only_name" in reply["matches"]
    msgs = execute(kernel, "print('still running:', not busy.done())")  # it answered while the cell ran
    assert "still running: True" in "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
    execute(kernel, "%mesh interrupt")


def test_auto_mode_runs_cells_on_the_mesh(kernel):
    msgs = execute(kernel, "%mesh auto")
    assert "auto mode on" in "".join(m["content"].get("text", "") for m in msgs)
    msgs = execute(kernel, "auto_value = rank + 100\nauto_value")
    (result,) = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result == "{0: 100, 1: 101}"
    reply = complete(kernel, "auto_val")
    assert "auto_value" in reply["matches"]
    msgs = execute(kernel, "%%local\n'kernel'")
    (result,) = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result == "'kernel'"
    msgs = execute(kernel, "%mesh status")
    status = [m for m in msgs if m["msg_type"] == "execute_result"][0]["content"]["data"]["text/plain"]
    assert "auto mode: on" in status
    execute(kernel, "%mesh auto off")
    msgs = execute(kernel, "'in the kernel'")
    (result,) = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result == "'in the kernel'"
