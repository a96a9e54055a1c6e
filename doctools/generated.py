"""Generated parts of the pages, written into the Markdown files themselves: a page reads the same raw (on GitHub,
in an editor, through the README's links) as on the site, and a docs test (tests/docs/test_generated.py) fails when
one is not what the code would write now.

A generated part is a region between two markers, with the kind of part in both::

    <!-- mj:magics -->

    ... generated Markdown ...

    <!-- /mj:magics -->

Kinds: ``magics`` (the magics reference, :func:`doctools.reference.render_magics`), ``config-mesh`` and
``config-magics`` (the option tables of the Chinese configuration page, :func:`doctools.reference.render_config`;
the English page is generated whole by ``monarch_jupyter.kernel.config.options_markdown``), and ``versions`` (the
table of the versions CI tests, scripts/versions.py: the floors of pyproject.toml and the versions of the
environment it was written from). A start marker without its end marker is filled in as a new region.

    python -m doctools.generated               rewrite every region but the versions table (after a change to a
                                               magic, an option, or a translation in docs/i18n/zh/reference.yml)
    python -m doctools.generated --versions    also the versions table, from this environment: run it in the newest
                                               environment CI tests, the .venv that bash .ci/run makes
    python -m doctools.generated --check       list the regions that are not current (exit status 1); write nothing
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from doctools import reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
START = re.compile(r"^<!-- mj:(?P<kind>[\w-]+) -->[ \t]*$", re.MULTILINE)
MARKER_LINE = re.compile(r"^<!-- /?mj:[\w-]+ -->[ \t]*\n", re.MULTILINE)

RENDER: dict[str, Callable[[str], str]] = {
    "magics": reference.render_magics,
    "config-mesh": lambda lang: reference.render_config(lang, "mesh"),
    "config-magics": lambda lang: reference.render_config(lang, "magics"),
}
VERSIONS = "versions"


def versions_module() -> ModuleType:
    """scripts/versions.py (a script, not a package: loaded by path, as the tests load scripts/floors.py)."""
    spec = importlib.util.spec_from_file_location("mj_versions", ROOT / "scripts" / "versions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def language(page: Path) -> str:
    return "zh" if page.name.endswith(".zh.md") else "en"


def pages() -> list[Path]:
    """Every Markdown page of docs/, both languages."""
    return sorted(DOCS.glob("*.md"))


def regenerate(text: str, lang: str, versions: dict[str, str] | None = None) -> str:
    """``text`` with every region rewritten as the code renders it now in ``lang``. The versions table is rewritten
    only when ``versions`` (an environment's versions, scripts/versions.py ``environment()``) is given.

    Raises
    ------
    ValueError
        A marker names a kind that does not exist.
    """
    out: list[str] = []
    pos = 0
    for m in START.finditer(text):
        if m.start() < pos:  # a marker line inside a region's old body belongs to that body
            continue
        kind = m.group("kind")
        if kind != VERSIONS and kind not in RENDER:
            raise ValueError(f"<!-- mj:{kind} -->: no such generated part (known: {', '.join([*RENDER, VERSIONS])})")
        end_marker = f"<!-- /mj:{kind} -->"
        end = text.find(end_marker, m.end())
        old_body = text[m.end():end] if end >= 0 else "\n"
        if kind == VERSIONS:
            body = (versions_module().table_markdown(lang, versions) if versions is not None
                    else old_body.strip("\n") + "\n")
        else:
            body = RENDER[kind](lang)
        out.append(text[pos:m.end()])
        out.append(f"\n\n{body.strip(chr(10))}\n\n{end_marker}")
        pos = end + len(end_marker) if end >= 0 else m.end()
    out.append(text[pos:])
    return "".join(out)


def strip_markers(text: str) -> str:
    """``text`` without the regions' marker lines, as the site shows it (the parts stay)."""
    return MARKER_LINE.sub("", text)


def stale(paths: list[Path] | None = None) -> list[Path]:
    """The pages whose regions (but the versions table) are not what :func:`regenerate` writes."""
    return [p for p in (paths or pages())
            if regenerate(p.read_text(encoding="utf-8"), language(p)) != p.read_text(encoding="utf-8")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m doctools.generated", description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", action="store_true", help="also rewrite the versions table from this environment")
    parser.add_argument("--check", action="store_true", help="list stale pages (exit status 1), write nothing")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for p in old:
            print(f"{p.relative_to(ROOT)}: a generated part is not current; run  python -m doctools.generated",
                  file=sys.stderr)
        return 1 if old else 0
    versions = versions_module().environment() if args.versions else None
    for p in pages():
        text = p.read_text(encoding="utf-8")
        new = regenerate(text, language(p), versions)
        if new != text:
            p.write_text(new, encoding="utf-8")
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
