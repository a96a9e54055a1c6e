"""The magics and configuration references are generated from the code, so they list exactly what it accepts."""

from __future__ import annotations

from doctools import hooks, reference


def test_every_subcommand_and_the_cell_magic_are_documented() -> None:
    from monarch_jupyter import magics

    names = [row.name for row in reference.magic_rows()]
    assert names == [f"%mesh {sub}" for sub in magics.SUBCOMMANDS] + ["%%mesh", "%%local"]


def test_magics_that_parse_by_hand_are_documented_from_the_usage_they_print(capsys) -> None:
    from monarch_jupyter.magics.auto import USAGE, AutoMode

    rows = {row.name: row for row in reference.magic_rows()}
    assert rows["%mesh auto"].usage == USAGE.splitlines()[0]
    assert [o.flags for o in rows["%mesh auto"].options] == ["on", "off", "OPTIONS"]
    assert [o.flags for o in rows["%mesh inspect"].options] == ["--rank, -r", "--frame", "--timeout", "EXPR"]
    assert rows["%%local"].usage == "%%local" and "in the kernel" in rows["%%local"].summary
    auto = AutoMode(shell=None)
    auto.command("--help")  # what the magics page says of every subcommand: --help prints its options
    assert capsys.readouterr().out.strip() == USAGE.strip() and not auto.on


def test_every_option_of_every_parser_is_in_the_magics_page() -> None:
    from monarch_jupyter.magics import MeshMagics

    page = reference.render_magics("en")
    for flag in ("--world-size", "--launcher", "--srun-args", "--pdb-commands", "--on-interrupt", "--no-widget",
                 "--async", "--force", "--grace", "--device", "--dim", "--commands", "--clear", "--frame"):
        assert f"`{flag}" in page or f", {flag}" in page, flag
    for action in MeshMagics._cell.parser._actions:
        for opt in action.option_strings:
            if opt not in ("-h", "--help"):
                assert opt in page, opt
    assert "%mesh listen" in page and "(required)" in page


def test_option_help_expands_percent_signs_as_help_does() -> None:
    page = reference.render_magics("en")
    assert "use %mesh listen for several hosts" in page
    assert "%%mesh listen" not in page


def test_config_rows_are_the_declared_options() -> None:
    from monarch_jupyter.magics import MeshMagics

    rows = {row.key: row for row in reference.config_rows()}
    traits = MeshMagics.class_traits(config=True)
    assert {row.trait for row in rows.values() if row.trait} == set(traits)
    assert rows["default_nproc"].default == 4
    assert rows["stream_order"].choices == ("arrival", "rank")
    assert rows["pg_timeout"].name == "pg_timeout" and not rows["pg_timeout"].trait


def test_chinese_configuration_tables_have_the_shape_of_the_generated_english_page() -> None:
    english_page = (reference.ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for scope in ("mesh", "magics"):
        assert reference.render_config("en", scope) in english_page  # same rows, same columns as the code's page
        en_rows = reference.render_config("en", scope).splitlines()
        zh_rows = reference.render_config("zh", scope).splitlines()
        assert len(en_rows) == len(zh_rows)
        assert [r.count(" | ") for r in en_rows] == [r.count(" | ") for r in zh_rows]


def test_the_chinese_references_are_in_chinese() -> None:
    zh = reference.render_magics("zh")
    assert "选项" in zh and "rank 的数量：即 world size" in zh
    assert "`--launcher`" in zh and "`{local,torchrun,agent,slurm}`" in zh  # flags and choices stay as they are
    config = reference.render_config("zh", "magics")
    assert "说明" in config and "不带 -n 的 `%mesh start` 启动的 rank 数。" in config


def test_markers_expand_in_both_languages() -> None:
    page = "intro\n\n<!-- mj:config-mesh -->\n\n<!-- norun: needs a GPU -->\n```python\nx\n```\n"
    en, zh = hooks.expand(page, "en"), hooks.expand(page, "zh")
    assert "`cell_timeout`" in en and '!!! info "Not run in CI"' in en and "needs a GPU" in en
    assert '!!! info "CI 中不运行"' in zh and "<!--" not in zh
