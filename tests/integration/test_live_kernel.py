"""A cell's view through a real Jupyter kernel (jupyter_client): what a frontend receives on IOPub.

Where a person watches (the request allows stdin, as JupyterLab's do): nothing when the cell starts; a quick cell's
one display at its end; a longer cell's live widget after ``DEFER`` seconds, the final state as an update of that
display (a placeholder first only when the kernel prints into the cell before: a pdb prompt); and the ranks' output
only there (no stream or display_data message of theirs beside it). Where nobody watches (nbval, nbconvert:
stdin off): one display at the cell's end. Either way the final ``text/plain`` holds the flat ``[rankN]:`` lines.
"""

from __future__ import annotations

import contextlib
import queue
import re
import time
from collections.abc import Iterator

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
PLAIN = "mesh cell on ranks 0,1"
WIDGET = "application/vnd.jupyter.widget-view+json"


@contextlib.contextmanager
def own_kernel() -> Iterator:
    """A fresh kernel's client; its mesh is stopped and the kernel shut down at the end."""
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


@pytest.fixture(scope="module")
def kernel():
    with own_kernel() as kc:
        yield kc


def execute_seeing_all(kc, code: str, seen: list[dict], timeout: float = 60.0) -> str:
    """Run ``code``; append every IOPub message to ``seen`` until it is idle, also those sent under an earlier
    cell's parent (a retired view's update); returns the request's msg_id."""
    msg_id = kc.execute(code, allow_stdin=True)
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        seen.append(msg)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return msg_id


def execute(kc, code: str, timeout: float = 60.0, allow_stdin: bool = True, errors: bool = True) -> list[dict]:
    """Run ``code``; IOPub messages of that execution until the kernel is idle again (errors raise)."""
    # stop_on_error=False: a cell of its own, not aborted after an earlier error (test_kernel.execute)
    msg_id = kc.execute(code, stop_on_error=False, allow_stdin=allow_stdin)
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


def html_updates(msgs: list[dict]) -> list[str]:
    return [m["content"]["data"]["state"]["value"] for m in msgs if m["msg_type"] == "comm_msg"
            and "mj-dashboard" in str(m["content"]["data"].get("state", {}).get("value", ""))]


def kinds(msgs: list[dict]) -> list[str]:
    """The output messages of a cell, in order."""
    return [m["msg_type"] for m in msgs if m["msg_type"] in ("stream", "display_data", "update_display_data",
                                                             "clear_output", "execute_result", "error")]


def last_view(msgs: list[dict]) -> dict:
    """The data of the cell view's last display (its first display, or its last update)."""
    return [m["content"]["data"] for m in msgs if m["msg_type"] in ("display_data", "update_display_data")][-1]


def test_live_cell_widget_then_final_state(kernel):
    execute(kernel, "%load_ext monarch")
    execute(kernel, "%mesh start -n 2")
    msgs = execute(kernel, LOOP)
    # No placeholder: the live widget is the first display (after DEFER s), the final state its update.
    assert kinds(msgs) == ["display_data", "update_display_data"]
    live, final = [m["content"] for m in msgs if m["msg_type"].endswith("display_data")]
    assert live["transient"] == final["transient"]  # one place: the same display throughout
    assert live["data"]["text/plain"] == PLAIN and WIDGET in live["data"] and WIDGET in final["data"]
    updates = html_updates(msgs)
    running = {int(n) for u in updates for n in re.findall(r'data-state="running" data-n="(\d+)"', u)}
    assert len(running & set(range(1, 8))) >= 3, running  # live: several intermediate counts while it ran
    assert 'data-final="true"' in updates[-1]  # the final state is sent before the cell ends
    assert re.findall(r'data-rank="(\d)" data-state="(\w+)" data-n="(\d+)"', updates[-1]) == [
        ("0", "done", "8"), ("1", "done", "8")]
    assert final["data"]["text/plain"] == PLAIN  # every rank done, no output: the header line only
    assert 'data-final="true"' in final["data"]["text/html"]


def test_a_cell_that_outlives_defer_gets_the_live_widget_even_when_the_ticker_is_late():
    """What a person sees follows how long the cell ran, not when the ticker thread got to run: a cell still running
    at DEFER gets the live widget (its rank tabs), made at its end if the ticker has not made it by then. The ticker
    is held asleep here (its own kernel: it stays asleep), so the cell ends first; were it to tick anyway, the
    widget would be there all the same."""
    with own_kernel() as kc:
        execute(kc, "%load_ext monarch")
        execute(kc, "%mesh start -n 2")
        execute(kc, "import time\nimport monarch_jupyter.widgets.view as _view\n_view.TICK = 3600.0\ntime.sleep(1.0)")
        msgs = execute(kc, "%%mesh\nimport time\nprint('ran', rank)\ntime.sleep(1.0)")
        shown = kinds(msgs)
        assert shown[0] == "display_data" and set(shown[1:]) <= {"update_display_data"}, shown
        first = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"][0]
        assert WIDGET in first and WIDGET in last_view(msgs)
        titles = [tuple(m["content"]["data"]["state"]["titles"]) for m in msgs if m["msg_type"] in ("comm_open",
                  "comm_msg") and "titles" in m["content"]["data"].get("state", {})]
        assert ("all ranks", "rank 0", "rank 1") in titles, titles  # the tab strip, a tab per rank
        assert sorted(last_view(msgs)["text/plain"].splitlines()[1:]) == ["[rank0]: ran 0", "[rank1]: ran 1"]


def test_output_shows_once_in_the_view_and_flat_in_its_text_plain(kernel):
    msgs = execute(kernel, "%%mesh\nimport sys, time\nprint('early', rank)\ntime.sleep(0.6)\n"
                           "print('late', rank, file=sys.stderr)\n")
    assert "stream" not in kinds(msgs)  # nothing beside the view
    final = [m["content"] for m in msgs if m["msg_type"] == "update_display_data"][-1]["data"]
    head, *flat = final["text/plain"].splitlines()
    assert head == PLAIN
    assert sorted(flat) == ["[rank0]: early 0", "[rank0]: late 0", "[rank1]: early 1", "[rank1]: late 1"]
    # The static form (nbconvert, GitHub): each line once in the output, under its rank's name (the table's "last
    # output" column repeats a rank's latest line on purpose).
    page = final["text/html"].split('<div class="mj-outputs">', 1)[1]
    assert page.count("early 0") == 1 and page.count("late 1") == 1
    assert re.search(r'class="mj-item mj-stderr" data-ranks=" 1 "><span class="mj-who"[^>]*>rank 1</span>'
                     r'<pre class="mj-text">late 1', page)


def test_quick_cell_is_compact_and_has_no_widget(kernel):
    # "Quick" is "ends within DEFER seconds": a long DEFER makes these cells quick however loaded the machine.
    execute(kernel, "import monarch_jupyter.widgets.celldash as _cd\n_defer, _cd.DEFER = _cd.DEFER, 60.0")
    try:
        _quick_cells(kernel)
    finally:
        execute(kernel, "_cd.DEFER = _defer")


def _quick_cells(kernel):
    msgs = execute(kernel, "%%mesh\nrank * 10")
    # No view: a quick cell that went well and printed nothing shows its result only, as a Python cell would.
    assert kinds(msgs) == ["execute_result"] and not [m for m in msgs if m["msg_type"].startswith("comm")]
    (result,) = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert "{0: 0, 1: 10}" in result, result
    msgs = execute(kernel, "%%mesh\nprint('hello from', rank)")
    assert kinds(msgs) == ["display_data"]  # a quick cell's messages coalesce into one: its final state
    final = last_view(msgs)
    assert sorted(final["text/plain"].splitlines()[1:]) == ["[rank0]: hello from 0", "[rank1]: hello from 1"]
    assert 'class="mj-table"' not in final["text/html"] and WIDGET not in final  # compact: no table, no widget
    msgs = execute(kernel, "%%mesh\nraise ValueError(f'no {rank}')", errors=False)
    assert kinds(msgs) == ["display_data", "error"]  # the view's final state, then the cell's error
    assert "error on ranks 0,1" in last_view(msgs)["text/plain"]


def test_unattended_run_gets_one_display_at_the_end(kernel):
    """nbval and nbconvert send cells with stdin off: nobody watches a live widget. One display, at the end, whose
    text/plain (compared by nbval) holds the flat lines: the same as a notebook saved from JupyterLab."""
    msgs = execute(kernel, "%%mesh --order rank\nimport time\nprint('a', rank)\ntime.sleep(0.6)\nprint('b', rank)",
                   allow_stdin=False)
    assert kinds(msgs) == ["display_data"]
    assert not [m for m in msgs if m["msg_type"].startswith("comm")]
    data = msgs[[m["msg_type"] for m in msgs].index("display_data")]["content"]["data"]
    assert data["text/plain"].splitlines() == [PLAIN, "[rank0]: a 0", "[rank0]: b 0",
                                               "[rank1]: a 1", "[rank1]: b 1"]
    assert 'data-final="true"' in data["text/html"] and "mj-table" in data["text/html"]  # a long cell: its table


def test_rank_displays_and_figures_are_in_the_view_under_their_rank(kernel):
    msgs = execute(kernel, "%%mesh\nfrom IPython.display import HTML, display\n"
                           "display(HTML(f'<b class=\"mine\">rich {rank}</b>'))\n")
    shown = kinds(msgs)  # the view's own display and its updates (live after DEFER s, final): none of the ranks'
    assert shown[0] == "display_data" and set(shown[1:]) <= {"update_display_data"}, shown
    final = last_view(msgs)
    assert sorted(final["text/plain"].splitlines()[1:]) == ["[rank0]: <IPython.core.display.HTML object>",
                                                            "[rank1]: <IPython.core.display.HTML object>"]
    for r in (0, 1):
        assert re.search(rf'data-ranks=" {r} "><span class="mj-who"[^>]*>rank {r}</span><div class="mj-rich[^"]*">'
                         rf'<b class="mine">rich {r}</b>', final["text/html"])


def test_no_output_line_lost_with_the_dashboard_on(kernel):
    msgs = execute(kernel, "%%mesh --order rank\nfor i in range(3000):\n    print(f'line {i}')\n")
    assert "stream" not in kinds(msgs)
    text = last_view(msgs)["text/plain"]
    for r in (0, 1):
        got = re.findall(rf"^\[rank{r}\]: line (\d+)$", text, re.M)
        assert got == [str(i) for i in range(3000)]


def test_the_lines_a_view_keeps_are_an_option_and_the_view_says_what_went(kernel):
    execute(kernel, "%config MeshMagics.output_lines = 50")
    try:
        text = last_view(execute(kernel, "%%mesh --order rank\nfor i in range(40):\n    print(f'n {i}')\n"))
    finally:
        execute(kernel, "%config MeshMagics.output_lines = 1000000")
    head, note, *flat = text["text/plain"].splitlines()
    assert note.startswith("(30 earlier lines not kept: `%config MeshMagics.output_lines = N` keeps more"), note
    assert len(flat) == 50 and flat[-1] == "[rank1]: n 39", flat
    text = last_view(execute(kernel, "%%mesh --order rank\nfor i in range(40):\n    print(f'n {i}')\n"))
    assert "not kept" not in text["text/plain"] and len(text["text/plain"].splitlines()) == 81

def test_a_cell_that_never_starts_shows_only_its_error(kernel):
    msgs = execute(kernel, "%%mesh\ndef (:", errors=False)
    assert kinds(msgs) == ["error"]  # nothing was shown, so nothing to take away


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


@pytest.mark.parametrize("pause", [0.5, 0.0], ids=["printed-while-result-waits", "printed-as-the-gate-opens"])
def test_an_async_cells_output_stays_in_it_when_a_later_cell_waits_for_its_result(kernel, tmp_path, pause):
    """``h.result()`` in a later cell while the ``--async`` cell still prints: the lines go to the async cell's view,
    once, and none to the cell that waits (which shows only the result). With no pause, the last lines often come
    before ``result()`` starts waiting, and the cell may end before it too (through the mesh's output writer, then
    ``cell_done``)."""
    by_parent: dict[str, list[dict]] = {}
    seen: list[dict] = []  # every message, in the order they came

    def run(code: str) -> str:  # as execute, keeping every message, of any cell, under its parent
        msg_id = kernel.execute(code, stop_on_error=False)
        deadline = time.monotonic() + 60
        while True:
            msg = kernel.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            by_parent.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
            seen.append(msg)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                return msg_id

    def display_id(msg: dict) -> str | None:
        return msg["content"].get("transient", {}).get("display_id")

    def view_of_a() -> str:  # the async cell's view: its display, or the last update of it (under any parent)
        return [m["content"]["data"] for m in seen if m["msg_type"] in ("display_data", "update_display_data")
                and display_id(m) in a_view][-1]["text/plain"]

    gate = tmp_path / "go"
    # The late line is printed ``pause`` seconds after the waiting cell opened the gate.
    a = run(f"%%mesh --async\nimport os, time\nprint('early', rank, flush=True)\n"
            f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\ntime.sleep({pause})\n"
            "print('late', rank)\nrank * 10")
    a_view = {display_id(m) for m in by_parent[a] if m["msg_type"] == "display_data"} - {None}
    assert a_view, [m["content"] for m in by_parent[a]]
    b = run(f"h = _\nopen({str(gate)!r}, 'w').close()\nh.result(60)")
    # ipykernel before 7 sends what other threads publish under the parent of the cell that runs now: updates of the
    # async cell's view may carry the waiting cell's parent. They update that view (its display_id), not this cell.
    own = [m for m in by_parent[b] if m["msg_type"] in ("stream", "display_data", "update_display_data",
                                                         "clear_output", "execute_result", "error")
           and not (m["msg_type"] == "update_display_data" and display_id(m) in a_view)]
    assert [m["msg_type"] for m in own] == ["execute_result"], [m["content"] for m in own]
    assert own[0]["content"]["data"]["text/plain"] == "{0: 0, 1: 10}"
    deadline = time.monotonic() + 30
    while not ("late 0" in view_of_a() and "late 1" in view_of_a()) and time.monotonic() < deadline:
        try:
            msg = kernel.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        by_parent.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
        seen.append(msg)
    flat = view_of_a().splitlines()[1:]
    assert sorted(flat) == ["[rank0]: early 0", "[rank0]: late 0", "[rank1]: early 1", "[rank1]: late 1"]
    assert "stream" not in kinds(by_parent[a]) + kinds(by_parent[b])


def test_a_pdb_prompt_lands_below_the_view(kernel):
    """The kernel prints the prompt into the cell: the view shows its placeholder first (kernel.output.hold_place),
    although the cell is still "quick" (a long DEFER) and would otherwise show nothing before its end."""
    execute(kernel, "import monarch_jupyter.widgets.celldash as _cd\n_defer, _cd.DEFER = _cd.DEFER, 60.0")
    try:
        msgs = execute(kernel, '%%mesh --pdb-commands "c"\nx = rank\nif rank == 0:\n    breakpoint()\nx')
    finally:
        execute(kernel, "_cd.DEFER = _defer")
    shown = kinds(msgs)
    assert shown[0] == "display_data" and "stream" in shown, shown
    first = msgs[[m["msg_type"] for m in msgs].index("display_data")]["content"]["data"]
    assert first["text/plain"] == PLAIN and WIDGET not in first  # the placeholder
    prompt = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    assert "Pdb rank 0" in prompt and "c" in prompt, prompt
    assert shown.index("display_data") < shown.index("stream")


def test_only_the_last_cells_keep_a_live_widget(kernel):
    """A long session keeps the widget models (6 comms a cell) of its last LIVE_CELL_VIEWS cells only: an older
    cell's display becomes its final state as static HTML, in place, and its widgets are closed."""
    execute(kernel, "import monarch_jupyter.widgets as _w\n_live, _w.LIVE_CELL_VIEWS = _w.LIVE_CELL_VIEWS, 2")
    seen: list[dict] = []
    try:
        firsts = []
        for i in range(4):  # each runs past DEFER: a live widget
            msg_id = execute_seeing_all(kernel, f"%%mesh\nimport time\nprint('cell {i}', rank)\ntime.sleep(0.6)", seen)
            firsts.append([m for m in seen if m["msg_type"] == "display_data"
                           and m["parent_header"].get("msg_id") == msg_id][0]["content"])
    finally:
        execute(kernel, "_w.LIVE_CELL_VIEWS = _live")
    ids = [f["transient"]["display_id"] for f in firsts]
    models = [f["data"][WIDGET]["model_id"] for f in firsts]
    updates = {i: [m["content"]["data"] for m in seen if m["msg_type"] == "update_display_data"
                   and m["content"]["transient"]["display_id"] == d] for i, d in enumerate(ids)}
    closed = {m["content"]["comm_id"] for m in seen if m["msg_type"] == "comm_close"}
    # The first two cells: their last update is static (no widget), with their output; their widgets are closed.
    for i in (0, 1):
        assert WIDGET not in updates[i][-1] and f"cell {i} 0" in updates[i][-1]["text/html"], updates[i][-1]
        assert f"[rank1]: cell {i} 1" in updates[i][-1]["text/plain"]
        assert models[i] in closed
    # The last two cells (LIVE_CELL_VIEWS, no more: 21 of 20 were kept, helper-63) keep theirs.
    assert all(WIDGET in updates[i][-1] for i in (2, 3)) and not {models[2], models[3]} & closed


def test_the_cells_of_a_stopped_mesh_are_retired_too():
    """The bound is the kernel's, not a mesh's: cells of a mesh that was stopped kept their widgets for the
    session (helper-61). Its own kernel: it stops its mesh."""
    seen: list[dict] = []
    with own_kernel() as kc:
        execute(kc, "%load_ext monarch\n%mesh start -n 2\nimport monarch_jupyter.widgets as _w\n_w.LIVE_CELL_VIEWS = 1")
        first = execute(kc, "%%mesh\nimport time\nprint('old', rank)\ntime.sleep(0.6)")
        shown = [m for m in first if m["msg_type"] == "display_data"]
        assert shown, kinds(first)
        display_id = shown[0]["content"]["transient"]["display_id"]
        execute(kc, "%mesh stop\n%mesh start -n 2")
        for i in range(2):
            execute_seeing_all(kc, f"%%mesh\nimport time\nprint('new {i}', rank)\ntime.sleep(0.6)", seen)
    static = [m["content"]["data"] for m in seen if m["msg_type"] == "update_display_data"
              and m["content"]["transient"]["display_id"] == display_id]
    assert static and WIDGET not in static[-1] and "old 0" in static[-1]["text/html"], static
