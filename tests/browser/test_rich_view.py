"""Rich output from ranks in a real browser: JupyterLab in headless Chromium (tests/browser/jlab.py).

One notebook session: an HTML display from each rank, a rank's matplotlib plot, a long cell whose live metric
chart moves while it runs and whose rank tabs filter its output in the browser, and Tab completion listing
a name that exists only on the ranks. Screenshots go to $BROWSER_TEST_ARTIFACTS, else build/browser-artifacts/
(under the checkout; build/ is ignored by git): html_display.png, plot.png, chart_running.png, rank_tabs.png,
completion.png.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from . import jlab
from .test_live_view import _package_path

_missing = jlab.browser_prerequisites_missing()
try:
    import matplotlib  # noqa: F401
except ImportError:
    _missing = _missing or "matplotlib is not installed (pip install '.[plots]')"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400),
              pytest.mark.skipif(_missing is not None, reason=_missing or "")]

ARTIFACTS = Path(os.environ.get("BROWSER_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parents[2] / "build" / "browser-artifacts")
STEPS = 16
CELLS: list[str | tuple[str, str]] = [
    "%load_ext monarch",
    "%mesh start -n 2",
    """%%mesh
from IPython.display import HTML, display
display(HTML(f'<b class="mj-test-html">HTML from rank {rank}</b>'))
rank_only_name = rank""",
    """%%mesh --ranks 0
import matplotlib.pyplot as plt
plt.plot([0, 1, 4, 9, 16])
plt.title("drawn on rank 0")""",
    f"""%%mesh
import time
from monarch_worker import progress
for step in range({STEPS}):
    time.sleep(0.25)
    print(f"rank {{rank}} step {{step}}")
    progress(step + 1, {STEPS}, desc="train", loss=1.0 / (step + 1) + 0.2 * rank)
display(HTML(f"<i class='mj-test-done'>rank {{rank}} finished</i>"))""",
    "%%mesh\nx = rank_on",
    "%mesh stop",
]

# Every element matching css, with the name of the rank it sits under in the cell's view.
_JS_OWN = """(area, css) => Array.from(area.querySelectorAll(css)).map(
                 e => [e.closest('.mj-item').querySelector('.mj-who').innerText, e.innerText])"""
_JS_POINTS = """(area) => Array.from(area.querySelectorAll('svg.mj-chart'), s => Number(s.dataset.points))"""


def test_rich_outputs_charts_tabs_and_completion_in_jupyterlab(tmp_path: Path) -> None:
    nb = jlab.write_notebook(tmp_path / "rich.ipynb", CELLS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with (
        jlab.jupyterlab_server(tmp_path, extra_env={"PYTHONPATH": _package_path()}) as server,
        jlab.chromium() as browser,
        jlab.open_notebook(browser, server, nb.name, failure_screenshot=ARTIFACTS / "rich_failure.png") as notebook,
    ):
        notebook.run_cell(0, timeout=60)
        notebook.run_cell(1, timeout=120)

        notebook.run_cell(2, timeout=60)
        html = notebook.output_area(2).locator(".mj-test-html")
        html.first.wait_for(state="visible", timeout=20_000)
        # Each display once, in the cell's view, under its rank's name.
        own = notebook.output_area(2).evaluate(_JS_OWN, ".mj-test-html")
        assert sorted(own) == [["rank 0", "HTML from rank 0"], ["rank 1", "HTML from rank 1"]]
        notebook.output_area(2).scroll_into_view_if_needed()
        notebook.screenshot(ARTIFACTS / "html_display.png")

        notebook.run_cell(3, timeout=90)
        img = notebook.output_area(3).locator(".mj-display img")
        img.first.wait_for(state="visible", timeout=20_000)
        assert img.count() == 1  # --ranks 0: one plot
        assert (img.first.get_attribute("src") or "").startswith(("data:image/png;base64,", "blob:"))
        notebook.output_area(3).scroll_into_view_if_needed()
        notebook.screenshot(ARTIFACTS / "plot.png")

        run = notebook.run_cell(4, wait=False)
        area = notebook.output_area(4)
        samples: list[list[int]] = []
        shot = False
        while not run.done():
            points = area.evaluate(_JS_POINTS)
            if points:
                samples.append(points)
                if len(samples) >= 6 and not shot:
                    area.scroll_into_view_if_needed()
                    notebook.screenshot(ARTIFACTS / "chart_running.png")
                    shot = True
            time.sleep(0.2)
        run.wait(60)
        moving = sorted({p[0] for p in samples})
        assert len(moving) >= 3, f"the chart did not move while the cell ran: {samples}"

        tabs = area.locator(".lm-TabBar-tab")
        tabs.first.wait_for(state="visible", timeout=20_000)
        assert tabs.all_inner_texts() == ["all ranks", "rank 0", "rank 1"]
        shown = area.locator(".mj-outputs-box")
        for r in (1, 0):
            tabs.nth(r + 1).click()  # the tab filters the view's one copy of the output, in the browser
            notebook.page.wait_for_function(
                "([el, other]) => !el.innerText.includes(other)", arg=[shown.element_handle(), f"rank {1 - r} step"],
                timeout=10_000)
            text = shown.inner_text() + area.locator(".mj-display").last.inner_text()
            assert f"rank {r} step {STEPS - 1}" in text and f"rank {r} finished" in text
            if r == 1:
                shown.scroll_into_view_if_needed()
                notebook.screenshot(ARTIFACTS / "rank_tabs.png")

        cell = notebook.cell(5)
        cell.locator(".jp-InputArea-editor").click()
        notebook.page.keyboard.press("Control+End")
        notebook.page.keyboard.press("Tab")
        completer = notebook.page.locator(".jp-Completer")
        completer.wait_for(state="visible", timeout=20_000)
        items = completer.locator(".jp-Completer-item").all_inner_texts()
        assert any("rank_only_name" in i for i in items), items
        notebook.screenshot(ARTIFACTS / "completion.png")
        notebook.page.keyboard.press("Escape")
        notebook.run_cell(6, timeout=60)
