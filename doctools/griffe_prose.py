"""A griffe extension for the API page: prose written after a docstring's numpy sections stays prose.

Some docstrings of the code end with a plain paragraph after their ``Parameters`` section (``Mesh``: "Ranks see
RANK, WORLD_SIZE ..."). The numpy parser reads such a paragraph's first words as parameter names and drops the
rest. This extension moves a paragraph that starts at column 0 inside a section, after a blank line, and does not
look like a ``name:`` entry, to just before the first section, where it renders as text. Nothing in the code
changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_UNDERLINE = re.compile(r"^-{3,}\s*$")
_ENTRY = re.compile(r"^\*{0,2}[A-Za-z_][\w.]*\s*(:.*)?$")  # "nproc:", "nproc : int", "MeshError"


def move_trailing_prose(text: str) -> str:
    lines = text.splitlines()
    first_section = next((i - 1 for i, ln in enumerate(lines) if i and _UNDERLINE.match(ln) and lines[i - 1].strip()),
                         None)
    if first_section is None:
        return text
    moved: list[str] = []
    out = lines[:first_section]
    i = first_section
    while i < len(lines):
        line = lines[i]
        starts_paragraph = i > first_section and not lines[i - 1].strip() and line and not line[0].isspace()
        is_header = i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1])
        if starts_paragraph and not is_header and not _ENTRY.match(line.strip()):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            moved += lines[i:j] + [""]
            i = j
            continue
        out.append(line)
        i += 1
    if not moved:
        return text
    head, tail = out[:first_section], out[first_section:]
    return "\n".join([*head, *([""] if head and head[-1].strip() else []), *moved, *tail]).rstrip() + "\n"


class ProseOutOfSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = move_trailing_prose(obj.docstring.value)
