"""The built site: English and Chinese pages with a language switch, notebooks rendered with their outputs,
search indexes in both languages, and screenshots of the getting-started page.

Uses ``site/`` when ``bash scripts/docs.sh`` built it after the last change to the docs (as in CI), else builds
the site into a temporary folder with the same strict command.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doctools import notebooks, screenshots, structure

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _newest_source() -> float:
    paths = [ROOT / "mkdocs.yml", *ROOT.glob("doctools/*.py"), *ROOT.glob("notebooks/*.ipynb"),
             *(p for p in structure.DOCS.rglob("*") if p.is_file() and "notebooks" not in p.parts)]
    return max(p.stat().st_mtime for p in paths)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("MJ_DOCS_SITE")
    if given:
        return Path(given)
    built = ROOT / "site"
    if (built / "index.html").exists() and (built / "index.html").stat().st_mtime >= _newest_source():
        return built
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _pages() -> list[str]:
    return [p.stem for p in structure.pages()] + [f"notebooks/{nb.stem}" for nb in notebooks.tutorials()]


def _html(site: Path, page: str, lang: str) -> str:
    prefix = "" if lang == "en" else f"{lang}/"
    path = site / prefix / ("index.html" if page == "index" else f"{page}/index.html")
    assert path.exists(), f"{path} was not built"
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", _pages())
def test_page_is_built_in_both_languages_with_a_language_switch(site: Path, page: str) -> None:
    for lang in ("en", "zh"):
        html = _html(site, page, lang)
        assert f'<html lang="{lang}"' in html
        assert 'hreflang="en"' in html and 'hreflang="zh"' in html, f"{lang}/{page}: no language switch"


def test_chinese_pages_are_chinese(site: Path) -> None:
    html = _html(site, "getting_started", "zh")
    assert "快速上手" in html and "在每个 rank 上运行一个单元格" in html
    assert "[rank0]: rank 0 of 4: [6.0, 6.0, 6.0]" in html  # outputs untouched


def test_notebooks_are_rendered_with_their_stored_outputs(site: Path) -> None:
    en, zh = _html(site, "notebooks/01_quickstart", "en"), _html(site, "notebooks/01_quickstart", "zh")
    for html in (en, zh):
        # A %%mesh cell's output is its view (docs/live_view.md): each line under its rank's name, as HTML.
        assert 'rank 0</span><pre class="mj-text">0 tensor([6., 6., 6.])</pre>' in html
        assert "test accuracy: 0.944 on 450 images" in html
    assert "用 DistributedDataParallel 在 scikit-learn 的 digits 数据集上训练一个小 MLP" in zh
    assert "Train a small MLP with DistributedDataParallel" in en


def test_generated_references_are_on_the_pages(site: Path) -> None:
    magics = _html(site, "magics", "en")
    assert "--pdb-commands" in magics and "number of ranks: the world size" in magics
    assert "rank 的数量：即 world size" in _html(site, "magics", "zh")
    assert "<code>stream_order</code>" in _html(site, "configuration", "zh")
    assert "单元格中 rank 输出的顺序" in _html(site, "configuration", "zh")
    for lang in ("en", "zh"):
        api = _html(site, "api", lang)
        for obj in ("Mesh", "Mesh.run", "Mesh.push", "Mesh.interrupt", "CellHandle.result", "RankMap", "current_mesh",
                    "errors.MeshError", "errors.RankDiedError", "errors.MeshTimeoutError", "Mesh.run_script",
                    "Mesh.complete", "Mesh.generation", "lightning.MeshStrategy", "lightning.MeshFabricStrategy",
                    "lightning.MeshEnvironment", "lightning.errors.MeshLightningError",
                    "lightning.errors.TrainingInterrupted"):
            assert f'id="monarch_jupyter.{obj}"' in api, (lang, obj)
        for obj in ("progress", "group.MeshGroupError", "scripts.ScriptExit"):
            assert f'id="monarch_worker.{obj}"' in api, (lang, obj)
    assert "%mesh run" in magics and "%mesh auto" in magics and "%%local" in magics


def test_norun_blocks_say_why(site: Path) -> None:
    assert "Not run in CI" in _html(site, "guide_mixed_precision", "en")
    assert "CI 中不运行" in _html(site, "guide_mixed_precision", "zh")


def test_search_index_covers_both_languages(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    docs = index["docs"]
    zh = [d for d in docs if d["location"].startswith("zh/")]
    en = [d for d in docs if not d["location"].startswith("zh/")]
    assert len(en) > 100 and len(zh) > 100
    # Chinese text is segmented into words (jieba) with zero-width spaces, which lunr splits on
    assert any("\u200b" in d["text"] for d in zh)
    assert any("进程组" in d["text"].replace("\u200b", "") for d in zh)
    assert any("process group" in d["text"] for d in en)
    assert "zh" in index["config"]["lang"] and "en" in index["config"]["lang"]


def test_screenshots_of_getting_started_in_both_languages(site: Path) -> None:
    why = screenshots.missing()
    if why:
        pytest.skip(f"no headless Chromium here ({why}); bash tests/browser/INSTALL.sh installs it")
    out = site / "_artifacts"
    wanted = [out / "getting_started.en.png", out / "getting_started.zh.png", out / "search.en.png",
              out / "search.zh.png"]
    index_time = (site / "index.html").stat().st_mtime
    if not all(p.exists() and p.stat().st_mtime >= index_time for p in wanted):
        screenshots.take(site, out)  # also checks the language switch and that search answers in both languages
    for png in wanted:
        assert png.stat().st_size > 20_000, png
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"getting_started", " ".join(p.name for p in out.iterdir()))
