"""The English and Chinese documentation cannot drift apart: every page, option help and notebook Markdown cell
has a current Chinese counterpart with the same structure (headings and anchors, code blocks, tables, markers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from doctools import cjk, hooks, notebooks, reference, runner, structure

ROOT = Path(__file__).resolve().parents[2]
PAGES = structure.pages()
# Pages whose every code block runs in CI (tests/docs/test_pages.py) or is marked not runnable, with the reason.
CHECKED_PAGES = ("getting_started.md", "guide_torchrun_slurm.md", "guide_mixed_precision.md",
                 "guide_data_loading.md", "torchrun.md", "lightning.md", "live_view.md")


def test_the_docs_have_pages() -> None:
    names = {p.name for p in PAGES}
    assert {"index.md", "getting_started.md", "troubleshooting.md", "magics.md", "api.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_english_page_has_a_chinese_page_with_the_same_structure(page: Path) -> None:
    zh = structure.translation(page)
    assert zh.exists(), f"{page.name} has no Chinese counterpart: write docs/{zh.name}"
    problems = structure.differences(page, zh)
    assert not problems, f"{page.name} and {zh.name} differ in structure:\n" + "\n".join(problems)


def test_a_paragraph_or_link_missing_from_a_translation_is_found(tmp_path: Path) -> None:
    en, zh = tmp_path / "page.md", tmp_path / "page.zh.md"
    note = "\n\n!!! note\n    Three.\n"
    en.write_text("# Page\n\nOne.\n\nTwo, see [x](x.md).\n\n- a\n- b" + note, encoding="utf-8")
    zh.write_text("# 页面 {#page}\n\n一。\n\n二，见 [x](x.md)。\n\n- 甲\n- 乙" + note, encoding="utf-8")
    assert structure.differences(en, zh) == []
    zh.write_text("# 页面 {#page}\n\n一。二，见 [x](x.md)。\n\n- 甲\n- 乙" + note, encoding="utf-8")
    assert structure.differences(en, zh) == ["section #page: page.md has 3 paragraph(s) and 2 list item(s), "
                                             "page.zh.md has 2 and 2"]
    zh.write_text("# 页面 {#page}\n\n一。\n\n二，见 [y](y.md)。\n\n- 甲\n- 乙，[x](x.md)" + note, encoding="utf-8")
    assert structure.differences(en, zh) == ["section #page: links to [] only in page.md, to ['y.md'] only in "
                                             "page.zh.md"]


def test_no_chinese_page_without_an_english_one() -> None:
    english = {p.name for p in PAGES}
    orphans = [p.name for p in structure.DOCS.glob("*.zh.md") if p.name.replace(".zh.md", ".md") not in english]
    assert not orphans


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_chinese_pages_are_written_in_chinese(page: Path) -> None:
    text = structure.translation(page).read_text(encoding="utf-8")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    han = len(re.findall(r"[\u4e00-\u9fff]", prose))
    assert han > 40, f"{page.name}: the Chinese page has only {han} Chinese characters outside code"


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1]
    missing = [p.name for p in PAGES if p.name not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
    for nb in notebooks.tutorials():
        assert f"notebooks/{nb.name}" in nav


def test_option_help_texts_have_current_translations() -> None:
    problems = reference.translation_problems()
    assert not problems, ("translate these in docs/i18n/zh/reference.yml "
                          "(python -m doctools.reference prints the current shape):\n" + "\n".join(problems))


def test_translation_table_has_no_stale_keys() -> None:
    table = reference.load_table()
    magics = {row.name: {o.key for o in row.options} for row in reference.magic_rows()}
    assert set(table["magics"]) == set(magics)
    for name, keys in magics.items():
        assert set(table["magics"][name].get("options") or {}) == keys, name
    assert set(table["config"]) == {row.key for row in reference.config_rows()}


@pytest.mark.parametrize("nb", notebooks.tutorials(), ids=lambda p: p.name)
def test_every_notebook_markdown_cell_has_a_current_translation(nb: Path) -> None:
    problems = notebooks.translation_problems(nb)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("nb", notebooks.tutorials(), ids=lambda p: p.name)
def test_chinese_notebooks_keep_code_and_outputs(nb: Path) -> None:
    en = notebooks.load(nb)
    zh = notebooks.translate(en, notebooks.table_for(nb))
    assert len(en["cells"]) == len(zh["cells"])
    for a, b in zip(en["cells"], zh["cells"], strict=True):
        assert a["cell_type"] == b["cell_type"]
        if a["cell_type"] == "code":
            assert a == b
        else:
            assert re.search(r"[\u4e00-\u9fff]", notebooks.source_text(b)), notebooks.source_text(a)[:80]
            # same heading levels, so the notebook's table of contents has the same shape
            levels = [len(h) for h in re.findall(r"^(#+) ", notebooks.source_text(a), re.M)]
            assert levels == [len(h) for h in re.findall(r"^(#+) ", notebooks.source_text(b), re.M)]


@pytest.mark.parametrize("name", CHECKED_PAGES)
def test_every_code_block_of_the_checked_pages_runs_or_says_why_not(name: str) -> None:
    for path in (structure.DOCS / name, structure.translation(structure.DOCS / name)):
        blocks, problems = runner.blocks(path.read_text(encoding="utf-8"))
        assert not problems, f"{path.name}:\n" + "\n".join(problems)
        assert any(b.kind == "cell" for b in blocks)


def test_a_cell_that_raises_fails_its_page_unless_the_page_shows_the_error() -> None:
    blocks, problems = runner.blocks("```python\n1 / 0\n```\n\n```python\nraise SystemExit(3)\n```\n\n```text\n"
                                     "SystemExit: 3\n```\n")
    assert not problems and [b.expected for b in blocks] == [None, "SystemExit: 3"]
    blocks[0].error, blocks[0].actual = "ZeroDivisionError: division by zero", "ZeroDivisionError: division by zero"
    blocks[1].error, blocks[1].actual = "SystemExit: 3", "SystemExit: 3\n"
    assert "raised ZeroDivisionError" in (runner.mismatch(blocks[0]) or "")
    assert runner.mismatch(blocks[1]) is None  # shown on the page: compared like any output


def test_the_api_page_finds_the_classes_the_lightning_module_builds_at_run_time() -> None:
    import griffe

    from doctools.griffe_runtime import RuntimeClasses

    pkg = griffe.load("monarch_jupyter", extensions=griffe.load_extensions(RuntimeClasses()),
                      docstring_parser="numpy")
    lightning = pkg["lightning"]
    init = lightning["MeshStrategy"]["__init__"]
    assert [p.name for p in init.parameters] == ["self", "mesh", "live_view", "progress", "fault_tolerant", "kwargs"]
    assert "DDP on the ranks" in lightning["MeshFabricStrategy"].docstring.value
    assert lightning["MeshEnvironment"].docstring is not None


def test_chinese_line_breaks_between_chinese_characters_do_not_become_spaces() -> None:
    page = ("## 标题 {#title}\n这一段\n被折行了，还有 `code`\n和 words\n继续。\n\n- 第一行，\n  第二行。\n\n"
            "```python\n# 注释，\n# 不动\n```\n")
    joined = ("## 标题 {#title}\n这一段被折行了，还有 `code`\n和 words\n继续。\n\n"
              "- 第一行，第二行。\n\n```python\n# 注释，\n# 不动\n```\n")
    assert cjk.join_lines(page) == joined
    zh = structure.translation(structure.DOCS / "torchrun.md").read_text(encoding="utf-8")
    assert "用相同的线程数运行 torch" not in zh and "用相同的线程数运行 torch" in hooks.expand(zh, "zh")


def test_the_chinese_readme_mirrors_the_english_one() -> None:
    problems = structure.differences(ROOT / "README.md", ROOT / "README.zh-CN.md", readme=True)
    assert not problems, "README.md and README.zh-CN.md differ in structure:\n" + "\n".join(problems)


def test_readmes_link_both_languages() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    zh = ROOT / "README.zh-CN.md"
    assert zh.exists()
    assert "README.zh-CN.md" in readme and "docs/getting_started.md" in readme
    zh_text = zh.read_text(encoding="utf-8")
    assert "README.md" in zh_text and "docs/getting_started.zh.md" in zh_text


def test_translation_tables_parse() -> None:
    for path in (structure.DOCS / "i18n" / "zh").rglob("*.yml"):
        assert isinstance(yaml.safe_load(path.read_text(encoding="utf-8")), dict), path


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506


def test_every_titled_nav_entry_has_a_chinese_title() -> None:
    config = _mkdocs_config()
    titles: list[str] = []

    def walk(items: list) -> None:
        for item in items:
            if isinstance(item, dict):
                for title, value in item.items():
                    titles.append(title)
                    if isinstance(value, list):
                        walk(value)

    walk(config["nav"])
    i18n = next(p["i18n"] for p in config["plugins"] if isinstance(p, dict) and "i18n" in p)
    zh = next(lang for lang in i18n["languages"] if lang["locale"] == "zh")
    missing = [t for t in titles if t not in zh["nav_translations"]]
    assert not missing, f"add these nav titles to the zh nav_translations in mkdocs.yml: {missing}"
