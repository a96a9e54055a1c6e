"""Run a page's code blocks as a user would, and compare their output with the output the page shows.

Every fenced block of a checked page (getting started, guides) is one of:

``python``                 a notebook cell: run, in page order, in one fresh Jupyter kernel (``%load_ext``,
                           ``%%mesh`` and all), started in a temporary folder
``python title="f.py"``    a file the page asks you to write (any language with ``title=``): written to that folder
``bash``                   a shell command: run there with ``bash -e``, after the files are written and the
                           notebook cells ran
``text``                   right after a ``python`` or ``bash`` block: what that block prints. Compared as a
                           multiset of lines (ranks' lines interleave in any order); with
                           ``<!-- output: digits vary -->`` before it, every run of digits is masked and runs
                           of blanks are squeezed first (timings). A ``%%mesh`` cell's dashboard counts with the
                           ranks' lines it holds (the flat text after its first line), not with its header.
                           A cell that raises must show its error this way: an error in a cell without a
                           ``text`` block fails the page (:func:`mismatch`).
any block after            not run, and the page shows why (:mod:`doctools.hooks`)
``<!-- norun: REASON -->``

Anything else is an error, so a new block cannot slip in untested.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)(?P<attrs>.*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
NORUN = re.compile(r"<!-- norun: .+ -->")
DIGITS_VARY = "<!-- output: digits vary -->"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Block:
    kind: str                 # cell | file | shell
    code: str
    line: int                 # 1-based line of the opening fence
    title: str = ""
    expected: str | None = None
    digits_vary: bool = False
    actual: str = field(default="", compare=False)
    error: str = field(default="", compare=False)  # the exception a cell raised ("" when none)


def _dedent(lines: list[str], indent: str) -> str:
    return "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines)


def blocks(text: str) -> tuple[list[Block], list[str]]:
    """The page's runnable blocks with their expected output, and the blocks that are neither run nor marked."""
    lines = text.splitlines()
    out: list[Block] = []
    problems: list[str] = []
    prev_nonblank = ""
    last_run: Block | None = None  # the block a following ``text`` block belongs to
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                if lines[i].strip() != DIGITS_VARY:
                    last_run = None
                prev_nonblank = lines[i].strip()
            i += 1
            continue
        start, indent, fence = i + 1, m.group("indent"), m.group("fence")
        lang, attrs = m.group("lang"), m.group("attrs")
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence)}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        code = _dedent(body, indent)
        marked = NORUN.fullmatch(prev_nonblank) is not None
        title = TITLE.search(attrs)
        if marked:
            last_run = None
        elif lang == "text" and last_run is not None and last_run.expected is None:
            last_run.expected = code
            last_run.digits_vary = prev_nonblank == DIGITS_VARY
            last_run = None
        elif title:
            out.append(Block("file", code, start, title=title.group("title")))
            last_run = None
        elif lang == "python":
            last_run = Block("cell", code, start)
            out.append(last_run)
        elif lang == "bash":
            last_run = Block("shell", code, start)
            out.append(last_run)
        else:
            problems.append(f"line {start}: a ```{lang} block that is neither run nor marked "
                            "<!-- norun: REASON --> (a ```text block must follow a run block directly)")
            last_run = None
        prev_nonblank = fence
    return out, problems


def _lines(text: str, digits_vary: bool) -> collections.Counter[str]:
    text = ANSI.sub("", text)
    if digits_vary:
        text = re.sub(r"[ \t]+", " ", re.sub(r"\d+", "N", text))
    return collections.Counter(ln.rstrip() for ln in text.splitlines() if ln.strip())


def mismatch(block: Block) -> str | None:
    """None when the block's actual output matches the page, else a readable difference. A cell that raised matches
    only an expected output (which then shows the error), so a failing cell with no output on the page is caught."""
    if block.expected is None:
        if block.error:
            return (f"block at line {block.line} ({block.kind}) raised {block.error}, and the page shows no output "
                    f"for it\n--- run output ---\n{block.actual}")
        return None
    want, got = _lines(block.expected, block.digits_vary), _lines(block.actual, block.digits_vary)
    if want == got:
        return None
    missing = list((want - got).elements())
    extra = list((got - want).elements())
    return (f"block at line {block.line} ({block.kind}): the page shows lines the run did not print: {missing}; "
            f"the run printed lines the page does not show: {extra}\n--- run output ---\n{block.actual}")


def _cell_output(outputs: list[dict]) -> str:
    parts = []
    for o in outputs:
        kind = o.get("output_type")
        if kind == "stream":
            parts.append(o.get("text", ""))
        elif kind == "execute_result":
            parts.append(o.get("data", {}).get("text/plain", "") + "\n")
        elif kind == "display_data" and 'class="mj-dashboard"' in str(o.get("data", {}).get("text/html", "")):
            flat = str(o["data"].get("text/plain", "")).split("\n", 1)  # a cell's view: its header, then its lines
            parts.append(flat[1] + "\n" if len(flat) > 1 else "")
        elif kind == "error":
            parts.append("\n".join(o.get("traceback", [])) + "\n")
    return "".join(parts)


def run(blocks_: list[Block], workdir: Path, timeout: float = 300.0, env: dict[str, str] | None = None) -> None:
    """Run the blocks (files, then notebook cells in one kernel, then shell commands); fills ``actual``."""
    import nbformat
    from nbclient import NotebookClient

    for b in blocks_:
        if b.kind == "file":
            path = workdir / b.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.code + "\n", encoding="utf-8")
    cells = [b for b in blocks_ if b.kind == "cell"]
    if cells:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(b.code) for b in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(workdir)}})
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            client.execute()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        for b, cell in zip(cells, nb.cells, strict=True):
            b.actual = _cell_output(cell.get("outputs", []))
            b.error = next((f"{o.get('ename')}: {o.get('evalue')}" for o in cell.get("outputs", [])
                            if o.get("output_type") == "error"), "")
    for b in blocks_:
        if b.kind == "shell":
            path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            proc = subprocess.run(["bash", "-e", "-c", b.code], cwd=workdir, capture_output=True, text=True,
                                  timeout=timeout, env={**os.environ, **(env or {}), "PATH": path})
            b.actual = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise RuntimeError(f"block at line {b.line} exited with {proc.returncode}:\n{b.code}\n"
                                   f"--- output ---\n{b.actual}")
