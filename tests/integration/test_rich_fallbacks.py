"""Rich output and completion where they fall back: plain IPython (no Jupyter frontend) shows the text of ranks'
displays, labelled; completion asked of a stopped or dead rank gives the kernel's own completions in time."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from IPython.core.completer import provisionalcompleter
from IPython.core.interactiveshell import InteractiveShell

from monarch_jupyter import Mesh
from monarch_jupyter.kernel import registry
from tests.conftest import magic_shell

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def small() -> Iterator[tuple[InteractiveShell, Mesh]]:
    shell = magic_shell()
    saved = registry.peek_current()
    m = Mesh(2, start_timeout=120)
    registry.set_current(m)
    try:
        yield shell, m  # type: ignore[misc]
    finally:
        m.stop()
        if saved is not None and saved.running:
            registry.set_current(saved)


def completions(shell: InteractiveShell, code: str) -> tuple[list[str], float]:
    t0 = time.monotonic()
    with provisionalcompleter():
        texts = [c.text for c in shell.Completer.completions(code, len(code))]
    return texts, time.monotonic() - t0


def test_plain_ipython_prints_the_text_of_rank_displays(small, capsys):
    shell, _ = small
    shell.run_cell_magic("mesh", "--no-widget --order rank", "from IPython.display import HTML, display\n"
                         "display(HTML('<b>bold</b>'))\ndisplay({'rank': rank})")
    out = capsys.readouterr().out
    assert "[rank0]: <IPython.core.display.HTML object>" in out
    assert "[rank1]: {'rank': 1}" in out


def test_completion_falls_back_when_a_rank_is_stopped_or_dead(small):
    shell, m = small
    shell.run_cell_magic("mesh", "--no-widget", "rank_side_name = 1")
    shell.user_ns["kernel_side_name"] = 2
    texts, _ = completions(shell, "%%mesh --ranks 1\nx = rank_side")
    assert "rank_side_name" in texts  # rank 1 answers
    pid = m.status()[1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        texts, _ = completions(shell, "%%mesh --ranks 1\nx = kernel_side")
        assert "kernel_side_name" in texts  # the kernel's own, after the 0.5 s budget (a hang: pytest's timeout)
        assert m.complete("rank_side", 9, 1, timeout=0.3) is None
    finally:
        os.kill(pid, signal.SIGCONT)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while m.status()[1]["state"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()  # dead: no wait at all, not even a fraction of a long timeout
    assert m.complete("rank_side", 9, 1, timeout=120) is None and time.monotonic() - t0 < 60
    texts, _ = completions(shell, "%%mesh --ranks 1\nx = kernel_side")
    assert "kernel_side_name" in texts
    texts, _ = completions(shell, "%%mesh\nx = rank_side")  # rank 0 still answers
    assert "rank_side_name" in texts


def test_completion_answers_while_the_rank_waits_at_a_pdb_prompt(mesh):
    """The rank's main thread is stopped in pdb; its I/O thread still answers from the rank's namespace."""
    mesh.run("names_before_pdb = 1", ranks=[0])
    handle = mesh.run("pdb_local = 5\nbreakpoint()\nafter_pdb = 1", ranks=[0], block=False)
    deadline = time.monotonic() + 30
    while mesh.status()[0]["state"] != "breakpoint" and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        reply = mesh.complete("names_bef", 9, 0, timeout=5)
        assert reply is not None and reply.matches == ["names_before_pdb"]
        reply = mesh.complete("pdb_loc", 7, 0, timeout=5)
        assert reply is not None and reply.matches == ["pdb_local"]  # the cell's own names, set before pdb
    finally:
        with mesh.debugger.options(["c"]):
            handle.result(30)


@pytest.mark.slow
def test_displays_of_joined_ranks_travel_over_their_socket():
    """Ranks started by torchrun run under a host agent, which takes a large display's bytes out of shared memory
    and relays them inside its batch (signed in a session of their own): they reach the cell (and the views'
    ``display`` event) intact, never dropped as replayed."""
    import base64

    m = Mesh(2, launcher="torchrun", start_timeout=120)
    seen: list[dict] = []
    m.add_listener(lambda kind, data: seen.append(data) if kind == "display" else None)
    try:
        m.run("class Png:\n    def _repr_png_(self):\n        return bytes(range(256)) * 300 + bytes([rank])\n"
              "display(Png())")
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        by_rank = {d["rank"]: base64.b64decode(d["data"]["image/png"]) for d in seen}
        assert by_rank == {r: bytes(range(256)) * 300 + bytes([r]) for r in (0, 1)}
    finally:
        m.stop()
