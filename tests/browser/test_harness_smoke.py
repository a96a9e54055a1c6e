"""Smoke test of the real-browser harness (tests/browser/jlab.py).

Opens a tiny notebook in JupyterLab in headless Chromium, runs plain cells and
an ipywidgets cell whose IntProgress/HTML widgets change over ~2 s, and checks
what the page shows: text outputs, rendered widgets, live widget updates while
the cell is still running, and the final state.  Leaves ``harness_smoke.png``
in the test's tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from . import jlab

_SKIP_REASON = jlab.browser_prerequisites_missing()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or ""),
]

STEPS = 10
WIDGET_CELL = f"""\
import time
import ipywidgets as widgets
from IPython.display import display

bar = widgets.IntProgress(value=0, min=0, max={STEPS}, description="steps")
label = widgets.HTML(value="step 0/{STEPS}")
display(widgets.VBox([bar, label]))
for i in range(1, {STEPS} + 1):
    time.sleep(0.2)
    bar.value = i
    label.value = f"step {{i}}/{STEPS}"
print("loop done")
"""

CELLS: list[str | tuple[str, str]] = [
    ("markdown", "# Harness smoke test"),
    "x = 6 * 7\nprint(f'answer={x}')",
    "x + 1",
    WIDGET_CELL,
    "print(bar.value, label.value)",
]


def _bar_percent(notebook: jlab.NotebookPage, index: int) -> float:
    style = notebook.widget(index, ".widget-hprogress .progress-bar").first.get_attribute("style") or ""
    match = re.search(r"width:\s*([\d.]+)%", style)
    return float(match.group(1)) if match else -1.0


def test_harness_smoke(tmp_path: Path) -> None:
    notebook_path = jlab.write_notebook(tmp_path / "smoke.ipynb", CELLS)
    screenshot = tmp_path / "harness_smoke.png"
    started = time.monotonic()

    with (
        jlab.jupyterlab_server(tmp_path) as server,
        jlab.chromium() as browser,
        jlab.open_notebook(
            browser, server, notebook_path.name, failure_screenshot=tmp_path / "failure.png"
        ) as notebook,
    ):
        assert notebook.status_text() == "Idle"
        assert notebook.cell_count() == len(CELLS)

        # Plain cells: stdout and an execute_result.
        notebook.run_cell(1)
        assert notebook.prompt(1) == "[1]:"
        assert notebook.output_text(1) == "answer=42"
        notebook.run_cell(2)
        assert notebook.output_text(2) == "43"

        # Widget cell: start it, then sample the DOM while it is still running.
        run = notebook.run_cell(3, wait=False)
        label = notebook.widget(3, ".widget-html-content")
        label.wait_for(state="visible", timeout=20_000)
        assert notebook.widget(3, ".widget-hprogress").first.is_visible()
        in_flight: list[tuple[str, float]] = []
        while not run.done():
            sample = (label.inner_text().strip(), _bar_percent(notebook, 3))
            if not run.done():  # the sample was taken while the cell was running
                in_flight.append(sample)
            time.sleep(0.1)
        run.wait()

        labels = [text for text, _ in in_flight]
        intermediate = {t for t in labels if t not in (f"step 0/{STEPS}", f"step {STEPS}/{STEPS}")}
        assert len(intermediate) >= 3, f"widget did not update live while running: {in_flight}"
        steps_seen = [int(re.search(r"step (\d+)/", t).group(1)) for t in labels]  # type: ignore[union-attr]
        assert steps_seen == sorted(steps_seen), f"widget went backwards: {labels}"
        percents = [p for _, p in in_flight]
        assert any(0 < p < 100 for p in percents), f"progress bar never partially filled: {in_flight}"

        # Final state: widgets, stdout of the same cell, kernel-side widget state, kernel idle.
        assert label.inner_text().strip() == f"step {STEPS}/{STEPS}"
        assert _bar_percent(notebook, 3) == pytest.approx(100.0)
        assert "loop done" in notebook.output_text(3)
        notebook.run_cell(4)
        assert notebook.output_text(4) == f"{STEPS} step {STEPS}/{STEPS}"
        notebook.wait_for_kernel_idle(10)
        assert notebook.prompt(0) == ""  # markdown cell has no prompt

        notebook.screenshot(screenshot)
        assert not [e for e in notebook.console if "widget" in e.lower()], notebook.console

    assert screenshot.stat().st_size > 10_000
    keep = os.environ.get("BROWSER_TEST_ARTIFACTS")
    if keep:  # optional: copy the screenshot somewhere persistent for inspection
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(keep) / screenshot.name)
    print(
        f"screenshot: {screenshot}; {len(in_flight)} in-flight samples, "
        f"{len(intermediate)} intermediate states; {time.monotonic() - started:.1f}s"
    )
