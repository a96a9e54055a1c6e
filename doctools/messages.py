"""Check that the messages the troubleshooting page shows are messages the code still produces.

Every string literal of the product's modules (``monarch_jupyter``, ``worker``, ``shim``) is a template: its
literal parts, with ``.+`` where an f-string puts a value. A message shown on the page (the first line of each
``text`` block of docs/troubleshooting.md) passes when some template of at least ``MIN_LITERAL`` literal
characters matches inside it. Blocks after ``<!-- message: external -->`` show messages of other software
(IPython, torch) and are skipped.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("monarch_jupyter", "worker", "shim")
PAGE = ROOT / "docs" / "troubleshooting.md"
MIN_LITERAL = 20
EXTERNAL = "<!-- message: external -->"
HOLE = "\x00"


def _template(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    return None


@lru_cache(maxsize=1)
def templates() -> tuple[tuple[re.Pattern[str], int], ...]:
    """(regex, literal length) of every string literal in the product's code."""
    out = []
    seen = set()

    def add(text: str) -> None:
        literal = len(text.replace(HOLE, ""))
        if literal < MIN_LITERAL or text in seen:
            return
        seen.add(text)
        parts = [re.escape(" ".join(p.split(" "))) for p in text.split(HOLE)]
        out.append((re.compile(".+?".join(parts), re.DOTALL), literal))

    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                    left, right = _template(node.left), _template(node.right)
                    if left is not None and right is not None:
                        add(left + right)
                t = _template(node)
                if t is not None:
                    add(t)
                    # the parts of a message split by "\n" are shown on lines of their own
                    for part in t.split("\n"):
                        add(part)
    return tuple(out)


def shown_messages(text: str) -> list[tuple[int, str]]:
    """(line number, first line) of every ``text`` block of the page that shows a message of ours."""
    lines = text.splitlines()
    out = []
    prev = ""
    for i, line in enumerate(lines):
        if line.startswith("```text"):
            if prev != EXTERNAL:
                out.append((i + 2, lines[i + 1]))
        if line.strip():
            prev = line.strip()
    return out


def unknown_messages(page: Path = PAGE) -> list[str]:
    """Messages on the page that no template of the code matches."""
    found = templates()
    problems = []
    for lineno, message in shown_messages(page.read_text(encoding="utf-8")):
        if not any(rx.search(message) for rx, _ in found):
            problems.append(f"{page.name}:{lineno}: no message of the code matches {message!r}")
    return problems


if __name__ == "__main__":
    print("\n".join(unknown_messages()) or "every message on the page is produced by the code")


def usage_error_templates() -> list[tuple[str, re.Pattern[str]]]:
    """(source location, regex) of every UsageError message written in the magics."""
    out = []
    for path in sorted((ROOT / "monarch_jupyter" / "magics").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "UsageError" and node.args:
                text = _template(node.args[0])
                if text is None or len(text.replace(HOLE, "")) < MIN_LITERAL:
                    continue
                first = text.split("\n")[0]
                rx = re.compile(".+?".join(re.escape(p) for p in first.split(HOLE)), re.DOTALL)
                out.append((f"{path.relative_to(ROOT)}:{node.lineno}", rx))
    return out


def undocumented_usage_errors(page: Path = PAGE) -> list[str]:
    """UsageError messages of the magics that no message on the page shows."""
    shown = [m for _, m in shown_messages(page.read_text(encoding="utf-8"))]
    return [f"{where}: {rx.pattern!r}" for where, rx in usage_error_templates()
            if not any(rx.search(m) for m in shown)]
