"""The section structure of a page, to keep each English page and its Chinese translation in step.

A page's structure is the sequence of its headings (level and anchor id), code blocks (language and exact text),
tables (number of rows), admonitions (kind), and markers (``<!-- output: ... -->``, ``<!-- message: ... -->``),
taken from the page as built (generated parts expanded, ``<!-- norun -->`` notes as admonitions); and, per
section, the number of paragraphs and list items and the links (their targets), read from the page as
Python-Markdown parses it (:func:`sections`). The Chinese page must have the same: the same code, the same number
of sections at the same levels with the same anchors (Chinese headings carry the English anchor as ``{#id}``), so
links with ``#anchor`` work in both languages, and in each section as many paragraphs and list items, linking to
the same places, so a paragraph added to one version and not the other is found, and neither version can drift
from the other unnoticed.
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree.ElementTree import Element

import markdown
from markdown.extensions import Extension
from markdown.treeprocessors import Treeprocessor
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


class _KeepTree(Treeprocessor):
    """Keeps the parsed page (after inline parsing: links are ``<a>`` elements) as ``md.tree``."""

    def run(self, root: Element) -> None:
        self.md.tree = root  # type: ignore[attr-defined]


class _KeepTreeExtension(Extension):
    def extendMarkdown(self, md: markdown.Markdown) -> None:  # noqa: N802 (Python-Markdown's name)
        md.treeprocessors.register(_KeepTree(md), "mj-keep-tree", 0)  # last: after the inline processor (20)


def _parse(text: str) -> markdown.Markdown:
    """``text`` parsed with the extensions of mkdocs.yml that shape headings, blocks and links."""
    md = markdown.Markdown(extensions=["attr_list", "md_in_html", "tables", "admonition", "footnotes",
                                       "pymdownx.superfences", "pymdownx.details", "toc", _KeepTreeExtension()],
                           extension_configs={"toc": {"slugify": slugify(case="lower")}})
    md.convert(text)
    return md


def heading_ids(text: str) -> list[tuple[int, str]]:
    """(level, id) of every heading, as MkDocs renders them (toc with pymdownx's slugify, attr_list ids)."""
    md = _parse(text)
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


@dataclass
class Section:
    """What one section (the text under a heading, up to the next heading) says, counted: its paragraphs (those
    inside admonitions too; a code block is not one) and list items, and the targets of its links."""

    id: str
    paragraphs: int = 0
    items: int = 0
    links: Counter[str] = field(default_factory=Counter)


_STASHED = re.compile(r"^(\s*\x02wzxhzdk:\d+\x03\s*)+$")  # a block Python-Markdown stashed (code, raw HTML)


def sections(text: str) -> list[Section]:
    """The page's sections in order, the first being what stands before the first heading (id ``""``)."""
    root: Element = _parse(text).tree  # type: ignore[attr-defined]
    out = [Section("")]

    def count(el: Element) -> None:
        if el.tag == "p" and el.get("class") != "admonition-title" and not _STASHED.match("".join(el.itertext())):
            out[-1].paragraphs += 1
        elif el.tag == "li":  # counted whole, with the items of lists inside it; its paragraphs are not the section's
            out[-1].items += sum(1 for _ in el.iter("li"))
            out[-1].links.update(a.get("href", "") for a in el.iter("a"))
            return
        elif el.tag == "a":
            out[-1].links[el.get("href", "")] += 1
        for child in el:
            count(child)

    for el in root:
        if re.fullmatch(r"h[1-6]", el.tag):
            out.append(Section(el.get("id", "")))
        else:
            count(el)
    return out


def section_differences(a: list[Section], b: list[Section], names: tuple[str, str]) -> list[str]:
    """How two pages' sections differ in paragraphs, list items and links (their headings are compared by
    :func:`structure`)."""
    out = []
    for x, y in zip(a, b, strict=False):
        where = f"section #{x.id}" if x.id else "the text before the first heading"
        if (x.paragraphs, x.items) != (y.paragraphs, y.items):
            out.append(f"{where}: {names[0]} has {x.paragraphs} paragraph(s) and {x.items} list item(s), "
                       f"{names[1]} has {y.paragraphs} and {y.items}")
        if x.links != y.links:
            only_a, only_b = sorted((x.links - y.links).elements()), sorted((y.links - x.links).elements())
            out.append(f"{where}: links to {only_a} only in {names[0]}, to {only_b} only in {names[1]}")
    return out


def _neutral(target: str) -> str:
    """A link target with its language taken out: docs/x.zh.md -> docs/x.md, README.zh-CN.md -> README.md."""
    return re.sub(r"\.zh(-CN)?\.md\b", ".md", target)


def differences(en: Path, other: Path, lang: str = "zh", readme: bool = False) -> list[str]:
    """How ``other``'s structure differs from ``en``'s (empty when they match), both as built: generated parts
    (``<!-- mj:... -->``) expanded, so a table generated for one language and written out in the other compare.

    ``readme``: a pair read on GitHub, README.md and README.zh-CN.md. GitHub shows ``{#id}`` as text, so the Chinese
    headings keep their own ids (compared by level), and each links to its own language's pages (link targets are
    compared with the language taken out)."""
    from doctools.hooks import expand

    en_text, other_text = expand(en.read_text(encoding="utf-8"), "en"), expand(other.read_text(encoding="utf-8"), lang)
    a, b = structure(en_text), structure(other_text)
    if readme:
        a, b = ([Item(i.kind, i.key.split("#")[0]) if i.kind == "heading" else i for i in items] for items in (a, b))
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
    if not out:  # same headings: compare what each section says
        sa, sb = sections(en_text), sections(other_text)
        if readme:
            for s in sa + sb:
                s.links = Counter({_neutral(t): n for t, n in s.links.items()})
        out = section_differences(sa, sb, (en.name, other.name))
    return out


def _first_diff(x: str, y: str) -> str:
    for lx, ly in zip(x.splitlines(), y.splitlines(), strict=False):
        if lx != ly:
            return f"{lx!r} vs {ly!r}"
    return "one is longer"
