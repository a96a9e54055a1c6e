"""JupyterLab's visual debugger on ranks, in a real browser (issue 28): JupyterLab 4 in headless Chromium
(tests/browser/jlab.py) on a 2-rank mesh, used as a user does.

The bug toggle in the notebook's toolbar turns the debugger on; a click in the gutter of a ``%%mesh`` cell sets a
breakpoint (JupyterLab computes the cell's path itself, ``dumpCell``); the cell runs and both ranks stop there. The
debugger sidebar's Callstack shows the cell's frame at that line and its Variables the stopped rank's own ``rank`` and
``x = rank * 10``. ``%mesh select 1`` (and ``0``) in the Debug Console that **Evaluate Code** opens switches the
sidebar to that rank's stack and variables. Continue (the Callstack's toolbar) resumes both ranks and the cell ends
with both ranks' values.

Screenshots while stopped go to $BROWSER_TEST_ARTIFACTS, else build/browser-artifacts/ (kept by CI): debugger/
light-1400-stopped.png and light-800-stopped.png (the whole window), light-1400-sidebar.png, dark-1400-sidebar.png,
light-800-sidebar.png (the sidebar showing rank 1, after ``%mesh select 1``), and failure.png when the test fails;
light-1400-postmortem.png (``%mesh debug --rank 1`` after a cell that raised on rank 1: its failing frame in the
sidebar, and the Debug Console's answer to ``%mesh select 0``) and failure-postmortem.png for the second test.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

from . import jlab
from .test_live_view import _package_path
from .test_one_view import _set_theme
from .test_rich_view import ARTIFACTS

_missing = jlab.browser_prerequisites_missing()
if importlib.util.find_spec("debugpy") is None:
    _missing = _missing or "debugpy is not installed (pip install 'monarch-jupyter[debug]')"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600),
              pytest.mark.skipif(_missing is not None, reason=_missing or "")]

SHOTS = ARTIFACTS / "debugger"
BREAK_LINE = 3  # the gutter's line number in the %%mesh cell below (its %%mesh line is line 1)
CELLS = [
    "%load_ext monarch",
    "%mesh start -n 2",
    "%%mesh\nx = rank * 10\ny = x + 1\nprint(f'rank {rank}: x={x} y={y}')\ny",
    "%%mesh\nz = rank + 5\nif rank == 1:\n    raise ValueError(f'rank {rank} fails')\nz",
    "%mesh debug --rank 1",
]
MESH_CELL = 2
FAILING_CELL, DEBUG_CELL, RAISE_LINE = 3, 4, 4  # the line of the failing cell that raises (its %%mesh line is 1)
SIDEBAR = "#jp-debugger-sidebar"

# {name: value} of the Variables panel (tree view), or null while it shows none.
_JS_VARIABLES = """
(css) => {
  const body = document.querySelector(css + ' .jp-DebuggerVariables-body');
  if (!body) return null;
  const out = {};
  for (const name of body.querySelectorAll('.jp-DebuggerVariables-name')) {
    const detail = name.parentElement.querySelector(':scope > .jp-DebuggerVariables-detail');
    out[name.textContent.trim()] = detail ? detail.textContent.trim() : null;
  }
  return Object.keys(out).length ? out : null;
}
"""
# The Callstack's frames as "name|location" strings.
_JS_FRAMES = """
(css) => Array.from(document.querySelectorAll(css + ' .jp-DebuggerCallstackFrame'),
                    f => f.innerText.replace(/\\s+/g, ' ').trim())
"""


def _wait_stopped_at(notebook: jlab.NotebookPage, rank: int | None, timeout: float = 60.0) -> dict[str, str]:
    """Wait until the sidebar shows a rank stopped at BREAK_LINE (``rank``: that one; None: any) with its own values
    (``rank`` and ``x = rank * 10``, no ``y`` yet); return the Variables panel's {name: value}."""
    js = """
    ([css, want, line]) => {
      const frames = Array.from(document.querySelectorAll(css + ' .jp-DebuggerCallstackFrame'),
                                f => f.innerText);
      if (!frames.some(f => f.includes(':' + line))) return false;
      const body = document.querySelector(css + ' .jp-DebuggerVariables-body');
      if (!body) return false;
      const vars = {};
      for (const name of body.querySelectorAll('.jp-DebuggerVariables-name')) {
        const d = name.parentElement.querySelector(':scope > .jp-DebuggerVariables-detail');
        vars[name.textContent.trim()] = d ? d.textContent.trim() : null;
      }
      const r = parseInt(vars['rank'], 10);
      if (Number.isNaN(r) || (want !== null && r !== want)) return false;
      return vars['x'] === String(r * 10) && !('y' in vars);
    }
    """
    notebook.wait_until(js, [SIDEBAR, rank, BREAK_LINE], timeout,
                        f"the debugger sidebar did not show {'a rank' if rank is None else f'rank {rank}'} stopped at "
                        f"line {BREAK_LINE} within {timeout:.0f}s; frames: {_frames(notebook)}, variables: "
                        f"{_variables(notebook)}")
    return _variables(notebook) or {}


def _variables(notebook: jlab.NotebookPage) -> dict[str, str] | None:
    return notebook.page.evaluate(_JS_VARIABLES, SIDEBAR)


def _frames(notebook: jlab.NotebookPage) -> list[str]:
    return notebook.page.evaluate(_JS_FRAMES, SIDEBAR)


def _set_gutter_breakpoint(notebook: jlab.NotebookPage, cell: int, line: int) -> None:
    """Click the breakpoint gutter beside line ``line`` (1-based) of cell ``cell``'s editor, as a user does."""
    editor = notebook.cell(cell).locator(".jp-InputArea-editor")
    gutter = editor.locator(".cm-gutter.cm-breakpoint-gutter")
    gutter.wait_for(state="visible", timeout=30_000)  # the debugger adds it (and line numbers) when it is on
    row = editor.locator(".cm-line").nth(line - 1).bounding_box()
    box = gutter.bounding_box()
    assert row and box, (row, box)
    notebook.page.mouse.click(box["x"] + box["width"] / 2, row["y"] + row["height"] / 2)


def _evaluate(notebook: jlab.NotebookPage, code: str) -> str:
    """Type ``code`` in the Debug Console (the one Evaluate Code opens), run it with Shift+Enter; return its output."""
    console = notebook.page.locator(".jp-DebugConsole")
    if not console.count():
        notebook.execute_command("debugger:evaluate")
        console.wait_for(state="visible", timeout=30_000)
    cells = console.locator(".jp-CodeConsole-content .jp-Cell")
    before = cells.count()
    prompt = console.locator(".jp-CodeConsole-promptCell .cm-content")
    # fill and press each focus the prompt first: a stop that %mesh select sends makes JupyterLab show the line in
    # the notebook, which moves the focus there, and keys typed after a click could land in the notebook's cell.
    prompt.fill(code)
    assert prompt.inner_text().strip() == code, prompt.inner_text()
    prompt.press("Shift+Enter")
    done = cells.nth(before).locator(".jp-OutputArea-output")
    done.wait_for(state="visible", timeout=30_000)
    return done.inner_text().strip()


def _sidebar_shot(notebook: jlab.NotebookPage, name: str) -> None:
    """The sidebar, its Variables panel scrolled to ``x`` (the panel is short: ``x`` is below the fold)."""
    notebook.page.locator(f"{SIDEBAR} .jp-DebuggerVariables-name", has_text="x").last.scroll_into_view_if_needed()
    notebook.page.locator(SIDEBAR).screenshot(path=str(SHOTS / name))


def test_gutter_breakpoint_in_a_mesh_cell(tmp_path: Path) -> None:
    nb = jlab.write_notebook(tmp_path / "debugger.ipynb", CELLS[:MESH_CELL + 1])
    SHOTS.mkdir(parents=True, exist_ok=True)
    (SHOTS / "failure.png").unlink(missing_ok=True)
    with (
        jlab.jupyterlab_server(tmp_path, extra_env={"PYTHONPATH": _package_path()}) as server,
        jlab.chromium() as browser,
        jlab.open_notebook(browser, server, nb.name, viewport=(1400, 1000), default_timeout=60,
                           failure_screenshot=SHOTS / "failure.png") as notebook,
    ):
        notebook.run_cell(0, timeout=60)
        notebook.run_cell(1, timeout=180)
        assert "world_size=2" in notebook.output_text(1), notebook.output_text(1)

        _debugger_on(notebook)

        _set_gutter_breakpoint(notebook, MESH_CELL, BREAK_LINE)
        # JupyterLab sends the cell (dumpCell) and its breakpoints; the Breakpoints panel lists it once they are set.
        notebook.page.locator(f"{SIDEBAR} .jp-DebuggerBreakpoint").first.wait_for(state="visible", timeout=30_000)
        lines = notebook.page.locator(f"{SIDEBAR} .jp-DebuggerBreakpoint-line").all_inner_texts()
        assert [t.strip() for t in lines] == [str(BREAK_LINE)], lines

        run = notebook.run_cell(MESH_CELL, wait=False)
        first = _wait_stopped_at(notebook, None, timeout=120)
        frames = _frames(notebook)
        assert any(f":{BREAK_LINE}" in f for f in frames), frames
        # Whose stack it is (the rank shown may change as the second rank's stopped event arrives: the last wins).
        assert all(re.match(r"rank [01]: <module>", f) for f in frames), frames
        notebook.page.locator(".jp-DebuggerPausedOverlay").first.wait_for(state="visible", timeout=30_000)
        # The cell's live view says where the stopped ranks wait (not "running", not a pdb prompt).
        view = notebook.output_area(MESH_CELL)
        view.get_by_text("stopped at a breakpoint in the visual debugger").first.wait_for(state="visible",
                                                                                           timeout=60_000)
        assert "Pdb rank" not in notebook.output_text(MESH_CELL)
        assert notebook.prompt(MESH_CELL) == "[*]:"  # the cell waits for its stopped ranks

        # Both ranks stopped before the picker is checked (a stopped event that came after would take the sidebar):
        # "%mesh select R" is refused until rank R is stopped.
        for r in (0, 1):
            deadline = time.monotonic() + 120
            while not _evaluate(notebook, f"%mesh select {r}").startswith(f"rank {r}:"):
                assert time.monotonic() < deadline, f"rank {r} did not stop at the breakpoint"
        # The rank picker in the Debug Console: each rank's own stack and values in the sidebar.
        shown = _evaluate(notebook, "%mesh select 1")
        assert shown.startswith("rank 1:"), shown
        assert _wait_stopped_at(notebook, 1)["x"] == "10"
        assert _frames(notebook)[0].startswith("rank 1: <module>"), _frames(notebook)
        notebook.screenshot(SHOTS / "light-1400-stopped.png")
        _sidebar_shot(notebook, "light-1400-sidebar.png")
        _set_theme(notebook, dark=True)
        _wait_stopped_at(notebook, 1, timeout=30)  # still rank 1 (JupyterLab asks debugInfo again now and then)
        _sidebar_shot(notebook, "dark-1400-sidebar.png")
        _set_theme(notebook, dark=False)
        notebook.page.set_viewport_size({"width": 800, "height": 1000})
        notebook.page.locator(SIDEBAR).wait_for(state="visible", timeout=30_000)
        _wait_stopped_at(notebook, 1, timeout=30)
        _sidebar_shot(notebook, "light-800-sidebar.png")
        notebook.screenshot(SHOTS / "light-800-stopped.png")
        notebook.page.set_viewport_size({"width": 1400, "height": 1000})
        # The notebook takes the focus again (JupyterLab restores the debugger's state): the sidebar keeps rank 1.
        notebook.cell(MESH_CELL).locator(".jp-InputPrompt").first.click()
        notebook.page.locator(".jp-DebugConsole .jp-CodeConsole-promptCell .cm-content").click()
        assert _wait_stopped_at(notebook, 1, timeout=30)["x"] == "10"

        shown = _evaluate(notebook, "%mesh select 0")
        assert shown.startswith("rank 0:"), shown
        assert _wait_stopped_at(notebook, 0)["x"] == "0"
        # The rank shown already, picked again: JupyterLab blanks the Variables panel on each evaluate; they come back.
        assert _evaluate(notebook, "%mesh select 0").startswith("rank 0:")
        assert _wait_stopped_at(notebook, 0, timeout=30)["rank"] == "0"
        assert int(first["rank"]) in (0, 1)

        # Continue (the Callstack's toolbar) resumes every stopped rank; the cell ends with both ranks' values.
        notebook.page.locator(f'{SIDEBAR} [data-command="debugger:continue"]').first.click()
        run.wait(120)
        text = notebook.output_text(MESH_CELL)
        assert "{0: 1, 1: 11}" in text, text
        for r in (0, 1):
            assert f"rank {r}: x={r * 10} y={r * 10 + 1}" in text, text
        notebook.page.locator(".jp-DebuggerPausedOverlay").first.wait_for(state="hidden", timeout=30_000)
        assert "stopped at a breakpoint" not in notebook.output_text(MESH_CELL)  # the view followed the continue



def _debugger_on(notebook: jlab.NotebookPage) -> None:
    """The bug toggle in the notebook's toolbar, then the debugger's sidebar (right)."""
    bug = notebook.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-DebuggerBugButton button").first
    notebook.wait_until("(el) => !el.disabled", bug.element_handle(), 60,
                        "the notebook's debugger toggle stayed disabled")
    bug.click()
    notebook.wait_until("(el) => el.getAttribute('aria-pressed') === 'true' || el.classList.contains("
                        "'lm-mod-toggled')", bug.element_handle(), 60, "the debugger did not turn on")
    notebook.page.evaluate("() => window.jupyterapp.shell.activateById('jp-debugger-sidebar')")
    notebook.page.locator(SIDEBAR).wait_for(state="visible", timeout=30_000)


def test_post_mortem_in_the_sidebar(tmp_path: Path) -> None:
    """``%mesh debug --rank 1`` after a cell that raised on rank 1: the failing frame and its values in the sidebar;
    ``%mesh select 0`` then (rank 0 is not stopped) is answered in the Debug Console; Continue ends the post-mortem."""
    cells = [CELLS[0], CELLS[1], CELLS[FAILING_CELL], CELLS[DEBUG_CELL]]
    nb = jlab.write_notebook(tmp_path / "postmortem.ipynb", cells)
    SHOTS.mkdir(parents=True, exist_ok=True)
    (SHOTS / "failure-postmortem.png").unlink(missing_ok=True)
    with (
        jlab.jupyterlab_server(tmp_path, extra_env={"PYTHONPATH": _package_path()}) as server,
        jlab.chromium() as browser,
        jlab.open_notebook(browser, server, nb.name, viewport=(1400, 1000), default_timeout=60,
                           failure_screenshot=SHOTS / "failure-postmortem.png") as notebook,
    ):
        notebook.run_cell(0, timeout=60)
        notebook.run_cell(1, timeout=180)
        _debugger_on(notebook)
        notebook.run_cell(2, timeout=120)
        assert "rank 1 fails" in notebook.output_text(2), notebook.output_text(2)
        debug = notebook.run_cell(3, wait=False)
        js = """
        ([css, line]) => {
          const frames = Array.from(document.querySelectorAll(css + ' .jp-DebuggerCallstackFrame'), f => f.innerText);
          if (!frames.length || !frames[0].startsWith('rank 1: <module>') || !frames[0].includes(':' + line)) {
            return false;
          }
          const body = document.querySelector(css + ' .jp-DebuggerVariables-body');
          if (!body) return false;
          return Array.from(body.querySelectorAll('.jp-DebuggerVariables-name'), n => {
            const d = n.parentElement.querySelector(':scope > .jp-DebuggerVariables-detail');
            return n.textContent.trim() + '=' + (d ? d.textContent.trim() : '');
          }).includes('z=6');
        }
        """
        notebook.wait_until(js, [SIDEBAR, RAISE_LINE], 120, f"the sidebar did not show rank 1's failing frame; "
                            f"frames: {_frames(notebook)}, variables: {_variables(notebook)}")
        notebook.output_area(3).get_by_text("stopped at the failing frame").first.wait_for(state="visible",
                                                                                           timeout=60_000)
        # A rank that is not stopped: the Debug Console prints why (not "Evaluation resulted in an error").
        refused = _evaluate(notebook, "%mesh select 0")
        assert "rank 0 is not stopped at a breakpoint (stopped now: rank 1)" in refused, refused
        notebook.wait_until(js, [SIDEBAR, RAISE_LINE], 30, f"the sidebar did not keep rank 1's failing frame; "
                            f"frames: {_frames(notebook)}, variables: {_variables(notebook)}")
        # The Variables panel is short: z (the rank's own value) is below the fold.
        notebook.page.locator(f"{SIDEBAR} .jp-DebuggerVariables-name", has_text="z").last.scroll_into_view_if_needed()
        notebook.screenshot(SHOTS / "light-1400-postmortem.png")
        notebook.page.locator(f'{SIDEBAR} [data-command="debugger:continue"]').first.click()
        debug.wait(120)
        notebook.page.locator(".jp-DebuggerPausedOverlay").first.wait_for(state="hidden", timeout=30_000)
