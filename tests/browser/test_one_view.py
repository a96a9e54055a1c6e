"""One clean view per cell, in a real browser: JupyterLab in headless Chromium (tests/browser/jlab.py), light and dark
themes, 1400 and 800 px wide, on a 2-rank mesh, with the cells a researcher runs first: output that starts at once,
a tqdm training loop with a loss, an error on one rank, a matplotlib figure and a table per rank, a Lightning ``fit``
with ``strategy="mesh"``, ``breakpoint()`` answered at its prompt, a quick cell and ``%mesh status``.

Asserted on the DOM: every line a rank printed is seen once, every figure's image once; no element sticks out of its
cell unless it is in a box that scrolls; chart titles and axis labels contrast with the background (computed colours,
WCAG ratio); the dashboard comes before what the kernel prints into the cell (a pdb prompt). Screenshots of each
cell in each theme and width go to $BROWSER_TEST_ARTIFACTS, else build/browser-artifacts/ (kept by CI):
one_view/<theme>-<width>-<cell>.png, and one_view/tab-rank1.png (the same cell with a rank's tab chosen).
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest

from . import jlab
from .pagecheck import contrast, count_visible, overflowing, precedes, visible_images, visible_text
from .test_live_view import _package_path
from .test_rich_view import ARTIFACTS

_missing = jlab.browser_prerequisites_missing()
if importlib.util.find_spec("matplotlib") is None:
    _missing = _missing or "matplotlib is not installed (pip install '.[plots]')"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900),
              pytest.mark.skipif(_missing is not None, reason=_missing or "")]

SHOTS = ARTIFACTS / "one_view"
LIGHTNING = importlib.util.find_spec("lightning") is not None
PANDAS = importlib.util.find_spec("pandas") is not None

TABLE = ("import pandas as pd\ntable = pd.DataFrame({'rank': [rank, rank], 'value': [rank * 10, rank * 10 + 1]})\n"
         if PANDAS else
         "from IPython.display import HTML\ntable = HTML(f\"<table class='dataframe'><tr><th>rank</th><td>{rank}</td>"
         "</tr><tr><th>value</th><td>{rank * 10}</td></tr></table>\")\n")

FIT = """\
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
trainer = L.Trainer(strategy="mesh", accelerator="cpu", devices=2, max_epochs=3, enable_checkpointing=False,
                    logger=False)
trainer.fit(Regression(), loader)
trainer.global_step"""

CELLS: dict[str, str] = {
    "load": "%load_ext monarch",
    "start": "%mesh start -n 2",
    "early": """%%mesh
import time
print(f"early line of rank {rank}")
time.sleep(1.0)
print(f"late line of rank {rank}")""",
    "tqdm": """%%mesh
import time
from tqdm.auto import tqdm
for epoch in range(3):
    bar = tqdm(range(16), desc=f"epoch {epoch}")
    for step in bar:
        time.sleep(0.05)
        loss = 15.0 if epoch == 0 and step < 3 else 0.4 / (1 + 0.05 * (16 * epoch + step))
        bar.set_postfix(loss=loss)
    print(f"epoch {epoch} of rank {rank}: loss={loss:.4f}")""",
    "error": """%%mesh
import time
print(f"rank {rank} starts")
if rank == 1:
    raise ValueError("batch 7 has NaNs")
time.sleep(0.5)
print("rank 0 done")""",
    "plot": f"""%%mesh
import matplotlib.pyplot as plt
from IPython.display import display
plt.plot([0, 1, 4, 9, 16 + rank])
plt.title(f"drawn on rank {{rank}}")
plt.show()
{TABLE}display(table)""",
    "fit": FIT if LIGHTNING else "'lightning is not installed'",
    "pdb": """%%mesh
x = rank * 10
if rank == 0:
    breakpoint()
print(f"after the breakpoint on rank {rank}: x={x}")""",
    # "Quick" is "ends within DEFER seconds": a long DEFER makes the next cell quick however loaded the machine.
    "slow_defer": "import monarch_jupyter.widgets.celldash as _cd\n_defer, _cd.DEFER = _cd.DEFER, 60.0",
    "quick": "%%mesh\nrank * 10",
    "defer": "_cd.DEFER = _defer",
    "status": "%mesh status",
    "stop": "%mesh stop",
}
INDEX = {name: i for i, name in enumerate(CELLS)}
STREAM = ('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"], '
          '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
SHOWN = ("early", "tqdm", "error", "plot", "fit", "pdb", "quick", "status")


def _set_theme(notebook: jlab.NotebookPage, dark: bool) -> None:
    theme = "JupyterLab Dark" if dark else "JupyterLab Light"
    notebook.execute_command("apputils:change-theme", {"theme": theme})
    notebook.page.wait_for_function("(light) => document.body.dataset.jpThemeLight === light",
                                    arg="false" if dark else "true", timeout=30_000)
    notebook.page.wait_for_timeout(300)  # the theme's stylesheet applies


def _run(notebook: jlab.NotebookPage, name: str, timeout: float = 120) -> None:
    notebook.run_cell(INDEX[name], timeout=timeout)


def _check_layout(notebook: jlab.NotebookPage, where: str) -> list[str]:
    """Overflow and contrast in every cell shown; returns what is wrong."""
    problems = []
    for name in SHOWN:
        area = notebook.output_area(INDEX[name])
        area.scroll_into_view_if_needed()
        for bad in overflowing(area):
            problems.append(f"{where} {name}: sticks out: {bad}")
        for item in contrast(area, "svg.mj-chart text, .mj-dashboard .mj-header, .mj-outputs pre.mj-text"):
            if item["ratio"] < 4.5:
                problems.append(f"{where} {name}: low contrast {item}")
    return problems


def test_one_clean_view_per_cell(tmp_path: Path) -> None:
    nb = jlab.write_notebook(tmp_path / "one_view.ipynb", list(CELLS.values()))
    SHOTS.mkdir(parents=True, exist_ok=True)
    with (
        jlab.jupyterlab_server(tmp_path, extra_env={"PYTHONPATH": _package_path()}) as server,
        jlab.chromium() as browser,
        jlab.open_notebook(browser, server, nb.name, viewport=(1400, 1600), default_timeout=60,
                           failure_screenshot=SHOTS / "failure.png") as notebook,
    ):
        _run(notebook, "load", 60)
        _run(notebook, "start", 180)

        # Output printed at once lands in the dashboard, as later output does: no stream output beside it.
        _run(notebook, "early")
        area = notebook.output_area(INDEX["early"])
        area.locator(".mj-cellview").wait_for(state="visible", timeout=30_000)
        for r in (0, 1):
            assert count_visible(area, f"early line of rank {r}") == 1, visible_text(area)
            assert count_visible(area, f"late line of rank {r}") == 1, visible_text(area)
        assert area.locator(STREAM).count() == 0

        _run(notebook, "tqdm")
        area = notebook.output_area(INDEX["tqdm"])
        chart = area.locator('svg.mj-chart[data-metric="loss"]')
        chart.wait_for(state="visible", timeout=30_000)
        for epoch in range(3):
            for r in (0, 1):
                assert count_visible(area, f"epoch {epoch} of rank {r}: loss=") == 1
        axis = chart.locator("text.mj-axis").all_text_contents()
        assert axis[-1] == "48", axis  # the global step: three epochs of 16, not 0-16 three times over
        digits = [len(re.sub(r"[^0-9]", "", t.split("e")[0]).lstrip("0")) for t in axis[:3]]
        assert max(digits) <= 3, axis  # about 3 significant figures
        # Both ranks report the same loss: one shared line named for both ranks, or (where their throttled reports
        # share too few steps to tell) two lines of different widths, so the one below still shows.
        legend = area.locator(".mj-legend").inner_text()
        lines = chart.locator("polyline")
        if lines.count() == 1:
            assert "ranks 0,1" in legend, legend
        else:
            assert "rank 0" in legend and "rank 1" in legend, legend
            widths = {lines.nth(i).get_attribute("stroke-width") for i in range(lines.count())}
            assert len(widths) == lines.count(), widths
        assert "first value off scale" in legend, legend
        box = chart.bounding_box()
        for label in chart.locator("text").all():
            b = label.bounding_box()
            assert box and b and b["x"] >= box["x"] - 0.5 and b["y"] >= box["y"] - 0.5, label.text_content()

        _run(notebook, "error")
        area = notebook.output_area(INDEX["error"])
        assert count_visible(area, "rank 0 starts") == 1 and count_visible(area, "rank 1 starts") == 1
        area.locator("li.lm-TabBar-tab", has_text="rank 1").wait_for(state="visible", timeout=30_000)
        tabs = area.locator("li.lm-TabBar-tab:visible")
        assert tabs.all_inner_texts() == ["all ranks", "rank 0", "rank 1"]  # the failed rank has its tab
        assert "ValueError: batch 7 has NaNs" in visible_text(area)

        _run(notebook, "plot", 180)
        area = notebook.output_area(INDEX["plot"])
        assert len(visible_images(area)) == 2, visible_images(area)  # one figure per rank, each once
        labels = area.locator(".mj-display .mj-who").all_inner_texts()
        assert labels == ["rank 0", "rank 0", "rank 1", "rank 1"] or sorted(labels) == sorted(
            ["rank 0", "rank 0", "rank 1", "rank 1"]), labels  # every figure and table under its rank's name
        assert area.locator(".mj-display table").count() == 2

        if LIGHTNING:
            _run(notebook, "fit", 600)
            area = notebook.output_area(INDEX["fit"])
            assert count_visible(area, "Total params") <= 1  # Lightning's model summary, once
            assert re.search(r"^12$", notebook.output_text(INDEX["fit"]), re.M)  # global_step: 3 epochs of 4 batches
            area.locator('svg.mj-chart[data-metric="loss"]').wait_for(state="visible", timeout=30_000)

        run = notebook.run_cell(INDEX["pdb"], wait=False)
        area = notebook.output_area(INDEX["pdb"])
        stdin = area.locator(".jp-Stdin-input")
        stdin.wait_for(state="visible", timeout=60_000)
        area.locator(".mj-dashboard").first.wait_for(state="attached", timeout=30_000)
        assert precedes(area, ".mj-dashboard", STREAM + ", .jp-Stdin") is True  # the prompt lands below the view
        notebook.page.wait_for_function(
            "(el) => Array.from(el.querySelectorAll('li.lm-TabBar-tab')).some("
            "t => t.textContent.trim() === 'rank 0' && t.getClientRects().length)",
            arg=area.element_handle(), timeout=30_000)  # the rank at the prompt has its tab
        area.scroll_into_view_if_needed()
        notebook.cell(INDEX["pdb"]).screenshot(path=str(SHOTS / "light-1400-pdb-prompt.png"))
        stdin.fill("c")
        stdin.press("Enter")
        run.wait(120)
        for r in (0, 1):
            assert count_visible(area, f"after the breakpoint on rank {r}: x={r * 10}") == 1

        _run(notebook, "slow_defer")
        _run(notebook, "quick")
        _run(notebook, "defer")
        area = notebook.output_area(INDEX["quick"])
        assert area.locator(".mj-cellview").count() == 0 and area.locator(".mj-table").count() == 0
        assert area.locator(".mj-dashboard").count() == 0  # went well, printed nothing: only its Out, as Python
        assert "{0: 0, 1: 10}" in notebook.output_text(INDEX["quick"])

        _run(notebook, "status")
        notebook.output_area(INDEX["status"]).locator(".mj-table").wait_for(state="visible", timeout=30_000)

        problems: list[str] = []
        for dark in (False, True):
            _set_theme(notebook, dark)
            for width in (1400, 800):
                notebook.page.set_viewport_size({"width": width, "height": 1600})
                notebook.page.wait_for_timeout(300)
                where = f"{'dark' if dark else 'light'}-{width}"
                problems += _check_layout(notebook, where)
                for name in SHOWN:
                    cell = notebook.cell(INDEX[name])
                    cell.scroll_into_view_if_needed()
                    cell.screenshot(path=str(SHOTS / f"{where}-{name}.png"))
        _set_theme(notebook, False)
        notebook.page.set_viewport_size({"width": 1400, "height": 1600})
        area = notebook.output_area(INDEX["tqdm"])
        area.locator("li.lm-TabBar-tab", has_text="rank 1").click()
        notebook.page.wait_for_timeout(300)
        assert count_visible(area, "epoch 2 of rank 1") == 1 and count_visible(area, "epoch 2 of rank 0") == 0
        notebook.cell(INDEX["tqdm"]).screenshot(path=str(SHOTS / "tab-rank1.png"))
        _run(notebook, "stop", 60)
        notebook.execute_command("docmanager:save")
        saved = _wait_saved(nb)
        # Its HTML export (jupyter nbconvert --to html), as a reader opens it.
        page = notebook.page.context.new_page()
        page.goto(_export_html(saved, tmp_path / "one_view.html").as_uri())
        exported = page.locator("body")
        for r in (0, 1):
            for line in (f"epoch 2 of rank {r}: loss=", f"early line of rank {r}", f"rank {r} starts",
                         f"after the breakpoint on rank {r}: x={r * 10}"):
                assert count_visible(exported, line) == 1, (line, visible_text(exported)[:4000])
        assert len(visible_images(exported.locator(".jp-Cell").nth(INDEX["plot"]))) == 2
        page.close()
        assert not notebook.console, notebook.console
    assert not problems, "\n".join(problems)
    # The saved notebook, as nbval and a plain view read it: no rank line beside the views; each view's text/plain
    # has each of its ranks' lines once.
    assert not any(o["output_type"] == "stream" and "[rank" in "".join(o.get("text", ""))
                   for c in saved["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    (view,) = [o for o in saved["cells"][INDEX["tqdm"]]["outputs"] if o["output_type"] == "display_data"]
    plain = "".join(view["data"]["text/plain"])
    for epoch in range(3):
        for r in (0, 1):
            assert plain.count(f"[rank{r}]: epoch {epoch} of rank {r}: loss=") == 1, plain


def _wait_saved(path: Path, timeout: float = 30.0) -> dict:
    """The notebook as JupyterLab saved it (once it holds the outputs of the last cell run)."""
    deadline = time.monotonic() + timeout
    while True:
        nb = json.loads(path.read_text())
        if nb["cells"][INDEX["stop"]].get("outputs"):
            return nb
        if time.monotonic() > deadline:
            raise AssertionError("JupyterLab did not save the notebook")
        time.sleep(0.2)


def _export_html(nb: dict, out: Path) -> Path:
    """``jupyter nbconvert --to html`` of the saved notebook (its Python API)."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.reads(json.dumps(nb), as_version=4))
    out.write_text(body, encoding="utf-8")
    return out
