"""The live per-rank dashboard in a real browser: JupyterLab in headless Chromium (tests/browser/jlab.py).

Runs ``%load_ext monarch``, ``%mesh start -n 2`` and a ``%%mesh`` cell with a progress loop; checks that the
dashboard rendered, that its progress bars moved while the cell ran, and that the final state shows done.
Saves ``live_view.png`` (in tmp_path; also copied to $BROWSER_TEST_ARTIFACTS when set).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from . import jlab
from .pagecheck import count_visible

_missing = jlab.browser_prerequisites_missing()

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300),
              pytest.mark.skipif(_missing is not None, reason=_missing or "")]

STEPS = 16
CELLS: list[str | tuple[str, str]] = [
    "%load_ext monarch",
    "%mesh start -n 2",
    f"""%%mesh
import time
from monarch_worker import progress
for step in range({STEPS}):
    time.sleep(0.25)
    progress(step + 1, {STEPS}, desc="train", loss=1.0 / (step + 1))
print("rank", rank, "finished")""",
    "%mesh stop",
]

# (rank, state, n) of every row of the dashboard in cell 2, read from the DOM.
_JS_ROWS = """
(area) => Array.from(area.querySelectorAll('.mj-dashboard tr.mj-row'),
                     tr => [tr.dataset.rank, tr.dataset.state, tr.dataset.n || null])
"""


def _package_path() -> str:
    """PYTHONPATH under which the kernel imports this checkout's packages (it inherits the server's env)."""
    import monarch_jupyter
    import monarch_worker

    dirs = [os.environ.get("PYTHONPATH", "")]
    dirs += [str(Path(m.__file__).resolve().parent.parent) for m in (monarch_jupyter,)]
    dirs += [str(Path(monarch_worker.__file__).parent.parent)]  # a .pth-style link dir, when used
    return os.pathsep.join(d for d in dict.fromkeys(dirs) if d)


def test_dashboard_live_in_jupyterlab(tmp_path: Path) -> None:
    nb = jlab.write_notebook(tmp_path / "live.ipynb", CELLS)
    shot = tmp_path / "live_view.png"
    with (
        jlab.jupyterlab_server(tmp_path, extra_env={"PYTHONPATH": _package_path()}) as server,
        jlab.chromium() as browser,
        jlab.open_notebook(browser, server, nb.name, failure_screenshot=tmp_path / "failure.png") as notebook,
    ):
        notebook.run_cell(0, timeout=60)
        notebook.run_cell(1, timeout=120)
        assert "Mesh world_size=2" in notebook.output_text(1)

        run = notebook.run_cell(2, wait=False)
        area = notebook.output_area(2)
        notebook.widget(2, ".mj-dashboard").first.wait_for(state="visible", timeout=30_000)
        samples: list[list] = []
        while not run.done():
            rows = area.evaluate(_JS_ROWS)
            if not run.done():
                samples.append(rows)
                if len(samples) == 15:
                    notebook.screenshot(tmp_path / "live_view_running.png")
            time.sleep(0.1)
        run.wait()
        notebook.page.wait_for_function(
            "(el) => !!el.querySelector('.mj-dashboard[data-final=\"true\"]')", arg=area.element_handle(),
            timeout=10_000)
        final = area.evaluate(_JS_ROWS)
        notebook.screenshot(shot)
        finished = [count_visible(area, f"rank {r} finished") for r in (0, 1)]  # besides the last-output column
        notebook.run_cell(3, timeout=60)

    running = {int(n) for rows in samples for _, state, n in rows if state == "running" and n is not None}
    assert len(running & set(range(1, STEPS))) >= 3, f"progress did not move while the cell ran: {samples}"
    assert final == [["0", "done", str(STEPS)], ["1", "done", str(STEPS)]]
    assert finished == [1, 1]  # each rank's line once, in the cell's view
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("BROWSER_TEST_ARTIFACTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in (shot, tmp_path / "live_view_running.png"):
            if png.exists():
                shutil.copy(png, Path(keep) / png.name)
