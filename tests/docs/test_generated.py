"""Generated parts are written into the pages (issue 31): a page reads the same raw as on the site, and says what
the code and CI say now. The versions table of docs/installation.md is checked against the environments CI tests:
its oldest column against the floors of pyproject.toml here (and against the oldest environment itself in
scripts/test-floors.sh), its newest column against this environment when it is the newest one CI tests."""

from __future__ import annotations

import os

import pytest

from doctools import generated, hooks

VERSIONS = generated.versions_module()


def test_every_generated_part_is_written_into_its_page() -> None:
    stale = generated.stale()
    assert not stale, (f"{[p.name for p in stale]}: a generated part (<!-- mj:... -->) is not what the code says "
                       "now; run  python -m doctools.generated  and commit the pages")


def test_the_pages_have_their_generated_parts() -> None:
    kinds = {p.name: generated.START.findall(p.read_text(encoding="utf-8")) for p in generated.pages()}
    assert kinds["magics.md"] == kinds["magics.zh.md"] == ["magics"]
    assert kinds["configuration.zh.md"] == ["config-mesh", "config-magics"]
    assert kinds["installation.md"] == kinds["installation.zh.md"] == ["versions"]


def test_a_region_is_filled_rewritten_and_found_stale() -> None:
    bare = "intro\n\n<!-- mj:config-magics -->\n\nafter\n"
    filled = generated.regenerate(bare, "en")
    assert filled.startswith("intro\n\n<!-- mj:config-magics -->\n\n| `MeshMagics` traitlet |")
    assert filled.endswith("|\n\n<!-- /mj:config-magics -->\n\nafter\n") and "`default_nproc`" in filled
    assert generated.regenerate(filled, "en") == filled  # current: unchanged
    stale = filled.replace("`default_nproc`", "`old_name`")
    assert generated.regenerate(stale, "en") == filled
    shown = hooks.expand(filled, "en")
    assert "mj:" not in shown and "`default_nproc`" in shown  # the site shows the part, not the markers
    with pytest.raises(ValueError, match="no such generated part"):
        generated.regenerate("<!-- mj:nonsense -->\n", "en")


def test_the_versions_table_is_kept_unless_asked_for() -> None:
    page = "<!-- mj:versions -->\n\n| Python | 1 | 2 |\n\n<!-- /mj:versions -->\n"
    assert generated.regenerate(page, "en") == page
    here = VERSIONS.environment()
    written = generated.regenerate(page, "zh", here)
    assert "| torch | 2.4.0 |" in written and "最旧" in written
    assert VERSIONS.read_table(written)["IPython"][1] == here["IPython"]


def test_the_oldest_column_is_the_floors_of_pyproject() -> None:
    floors = VERSIONS.floors()
    for page in VERSIONS.PAGES:
        rows = VERSIONS.read_table(page.read_text(encoding="utf-8"))
        assert set(rows) == {label for label, _ in VERSIONS.TABLE}, page.name
        said = {label: oldest for label, (oldest, _) in rows.items() if label != "Python"}
        assert said == floors, (f"{page.name}: the oldest column is not the floors of pyproject.toml; run  "
                                "python -m doctools.generated --versions  in the newest environment")
        assert rows["Python"][0] == rows["Python"][1]  # one interpreter makes both environments


def test_a_wrong_version_in_the_table_is_reported(tmp_path) -> None:
    here = VERSIONS.environment()
    page = tmp_path / "installation.md"
    page.write_text(VERSIONS.table_markdown("en", {**here, "numpy": "0.1.0"}), encoding="utf-8")
    assert VERSIONS.check("newest", (page,)) == [f"installation.md: numpy 0.1.0 in the 'newest' column, "
                                                 f"{here['numpy']} here"]
    page.write_text(VERSIONS.table_markdown("en", here), encoding="utf-8")
    assert VERSIONS.check("newest", (page,)) == []


@pytest.mark.skipif(os.environ.get("MJ_VERSIONS_ENVIRONMENT") != "newest",
                    reason="checked in the newest environment CI tests: the .venv that bash .ci/run makes "
                           "(it sets MJ_VERSIONS_ENVIRONMENT=newest)")
def test_the_newest_column_is_this_environment() -> None:
    problems = VERSIONS.check("newest")
    assert not problems, ("\n".join(problems) + "\nThe table no longer names the versions CI tests: run  "
                          ".venv/bin/python -m doctools.generated --versions  (in the .venv bash .ci/run made) and "
                          "commit docs/installation.md and docs/installation.zh.md")
