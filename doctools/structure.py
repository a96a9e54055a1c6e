"""The section structure of a page, to keep each English page and its Chinese translation in step.

A page's structure is the sequence of its headings (level and anchor id), code blocks (language and exact text),
tables (number of rows), admonitions (kind), and markers (``<!-- output: ... -->``, ``<!-- message: ... -->``),
taken from the page as built (generated parts expanded, ``<!-- norun -->`` notes as admonitions). The
Chinese page must have the same sequence: the same code, the same number of sections at the same levels with the
same anchors (Chinese headings carry the English anchor as ``{#id}``), so links with ``#anchor`` work in both
languages and neither version can drift from the other unnoticed.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import markdown
from pymdownx.slugs import slugify

DOCS = Path(__file__).resolve().parent.parent / "docs"
LANGS = ("zh",)

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"<!-- (?P<kind>mj:[\w-]+|norun|output|message):?.*?-->")
ADMONITION = re.compile(r"^[ \t]*(?:!!!|\?\?\?\+?)\s+(?P<kind>\w+)")


@dataclass(frozen=True)
class Item:
    kind: str      # heading | code | table | admonition | marker | directive (mkdocstrings ``:::``)
    key: str       # level+id, language, rows, kind, marker kind
    text: str = ""  # code block text

    def __str__(self) -> str:
        if self.kind == "code":
            first = self.text.strip().splitlines()[0] if self.text.strip() else ""
            return f"code[{self.key}] {first[:60]!r}"
        return f"{self.kind}[{self.key}]"


def pages() -> list[Path]:
    """English source pages (``docs/*.md`` without a language suffix)."""
    return sorted(p for p in DOCS.glob("*.md") if not re.search(r"\.[a-z]{2}(_[A-Z]{2})?\.md$", p.name))


def translation(page: Path, lang: str = "zh") -> Path:
    return page.with_name(f"{page.stem}.{lang}.md")


def heading_ids(text: str) -> list[tuple[int, str]]:
    """(level, id) of every heading, as MkDocs renders them (toc with pymdownx's slugify, attr_list ids)."""
    md = markdown.Markdown(extensions=["attr_list", "md_in_html", "tables", "admonition", "pymdownx.superfences",
                                       "toc"],
                           extension_configs={"toc": {"slugify": slugify(case="lower")}})
    md.convert(text)
    out: list[tuple[int, str]] = []

    def walk(tokens: list[dict]) -> None:
        for t in tokens:
            out.append((t["level"], t["id"]))
            walk(t["children"])

    walk(md.toc_tokens)  # type: ignore[attr-defined]
    return out


def structure(text: str) -> list[Item]:
    """The page's structure items, in order."""
    items: list[Item] = []
    lines = text.splitlines()
    headings = iter(heading_ids(text))
    i = 0
    in_table = 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            if in_table:
                items.append(Item("table", str(in_table)))
                in_table = 0
            indent, fence = m.group("indent"), m.group("fence")
            lang = (m.group("info").strip().split() or [""])[0].lstrip("{.").rstrip("}")
            body = []
            i += 1
            while i < len(lines) and not re.match(rf"^{re.escape(indent)}{re.escape(fence)}\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            items.append(Item("code", lang, textwrap.dedent("\n".join(body))))
            i += 1
            continue
        if line.lstrip().startswith("|"):
            in_table += 1
        elif in_table:
            items.append(Item("table", str(in_table)))
            in_table = 0
        if re.match(r"^#{1,6}\s", line):
            level, hid = next(headings)
            items.append(Item("heading", f"h{level}#{hid}"))
        for mm in MARKER.finditer(line):
            items.append(Item("marker", mm.group("kind")))
        if line.startswith("::: "):
            items.append(Item("directive", line[4:].strip()))
        am = ADMONITION.match(line)
        if am:
            items.append(Item("admonition", am.group("kind")))
        i += 1
    if in_table:
        items.append(Item("table", str(in_table)))
    return items


def differences(en: Path, other: Path, lang: str = "zh") -> list[str]:
    """How ``other``'s structure differs from ``en``'s (empty when they match), both as built: generated parts
    (``<!-- mj:... -->``) expanded, so a table generated for one language and written out in the other compare."""
    from doctools.hooks import expand

    a = structure(expand(en.read_text(encoding="utf-8"), "en"))
    b = structure(expand(other.read_text(encoding="utf-8"), lang))
    out = []
    for n, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            out.append(f"item {n}: {en.name} has {x}, {other.name} has {y}")
            if x.kind == y.kind == "code" and x.key == y.key:
                out.append(f"  (code blocks must be identical; first differing line: "
                           f"{_first_diff(x.text, y.text)})")
            break
    if len(a) != len(b) and not out:
        longer, name = (a, en.name) if len(a) > len(b) else (b, other.name)
        out.append(f"{name} has {abs(len(a) - len(b))} more item(s), from {longer[min(len(a), len(b))]}")
    return out


def _first_diff(x: str, y: str) -> str:
    for lx, ly in zip(x.splitlines(), y.splitlines(), strict=False):
        if lx != ly:
            return f"{lx!r} vs {ly!r}"
    return "one is longer"
