"""Soft line breaks in Chinese Markdown.

The Chinese pages are wrapped at 120 columns like the English ones. Markdown turns a line break inside a paragraph
into a space, which English needs and Chinese does not: between two Chinese characters it shows as a gap in the
middle of a phrase. :func:`join_lines` removes the line breaks that fall between two CJK characters (or CJK
punctuation), outside code blocks, before the page is rendered. A line that starts with anything else (a list
marker, a table, a heading, a fence, Latin text or inline code), and a line after a heading, is left where it is,
so only the gaps go.
"""

from __future__ import annotations

import re

CJK = "\u2014\u2018-\u201d\u2026\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef"
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
_ENDS_CJK = re.compile(f"[{CJK}]$")
_STARTS_CJK = re.compile(f"^[ \t]*[{CJK}]")


def join_lines(markdown: str) -> str:
    """``markdown`` with every line break between two CJK characters removed (code blocks untouched)."""
    out: list[str] = []
    fence = ""
    for line in markdown.split("\n"):
        m = _FENCE.match(line)
        if fence:
            if m and m.group(1).startswith(fence[0]) and len(m.group(1)) >= len(fence):
                fence = ""
            out.append(line)
            continue
        if m:
            fence = m.group(1)
            out.append(line)
            continue
        if out and _ENDS_CJK.search(out[-1]) and _STARTS_CJK.match(line) and not out[-1].lstrip().startswith("#"):
            out[-1] += line.lstrip(" \t")
            continue
        out.append(line)
    return "\n".join(out)
