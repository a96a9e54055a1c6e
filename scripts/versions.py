"""The versions CI tests: print them, write the table of docs/installation.md from them, check that table.

    python scripts/versions.py LABEL                 one line: this environment's Python and packages (.ci/run)
    python scripts/versions.py --check newest|oldest [PAGE ...]
                                                     the PAGEs' table (default: docs/installation.md and its
                                                     Chinese page) against this environment, in that column

CI runs the tests in two environments: the newest (what ``scripts/setup.sh --dev`` installs into a fresh .venv)
and the oldest (every dependency at its floor in pyproject.toml, ``scripts/test-floors.sh``). The table in
docs/installation.md names both: its "oldest" column is the floors (``floors()``), its "newest" column the
versions of the environment the table was written from (``python -m doctools.generated --versions``, run in the
newest environment). CI checks each column in its own environment: the newest through the docs tests
(tests/docs/test_generated.py, when .ci/run tests a .venv it made: MJ_VERSIONS_ENVIRONMENT=newest), the oldest in
scripts/test-floors.sh with ``--check oldest``. Standard library and ``packaging`` only: it runs in the oldest
environment too.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "docs" / "installation.md", ROOT / "docs" / "installation.zh.md")
NAMES = ["torch", "numpy", "ipython", "ipykernel", "jupyter_client", "jupyter_core", "pyzmq", "cloudpickle",
         "traitlets", "ipywidgets", "pytest", "setuptools"]
# The table's rows: what it calls each, and the distribution (None: the Python interpreter). Every runtime
# dependency of pyproject.toml, so each has a floor.
TABLE = [("Python", None), ("torch", "torch"), ("IPython", "ipython"), ("ipykernel", "ipykernel"),
         ("numpy", "numpy"), ("pyzmq", "pyzmq"), ("cloudpickle", "cloudpickle"), ("traitlets", "traitlets"),
         ("ipywidgets", "ipywidgets"), ("jupyter_core", "jupyter_core")]
HEADERS = {"en": ("", "oldest (the floors)", "newest tested"), "zh": ("", "最旧（版本下限）", "最新（测试过的）")}
ROW = re.compile(r"^\|\s*(?P<name>[\w.-]+)\s*\|\s*(?P<oldest>[\w.+-]+)\s*\|\s*(?P<newest>[\w.+-]+)\s*\|\s*$")


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def _release(text: str) -> str:
    """'2.4' -> '2.4.0', '2.13.0+cpu' -> '2.13.0': the public version, its release padded to three parts."""
    v = Version(text)
    if v.pre or v.post or v.dev:
        return v.public
    return ".".join(map(str, (*v.release, 0, 0)[:max(3, len(v.release))]))


def environment() -> dict[str, str]:
    """This environment's version of every row of the table ('-' for a package that is not installed)."""
    out = {}
    for label, dist in TABLE:
        found = platform.python_version() if dist is None else installed(dist)
        out[label] = found if found == "-" else _release(found)
    return out


def floors() -> dict[str, str]:
    """The oldest column's packages: each one's floor in pyproject.toml (scripts/floors.py)."""
    spec = importlib.util.spec_from_file_location("floors", ROOT / "scripts" / "floors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pins = dict(line.split("==") for line in module.constraints())
    return {label: _release(pins[dist.replace("_", "-").lower()]) for label, dist in TABLE if dist is not None}


def table_markdown(lang: str, newest: dict[str, str]) -> str:
    """The table for a page in ``lang``: the floors, and ``newest`` (an environment's versions). Python is the same
    in both columns: the oldest environment's venv is made from the interpreter that runs CI."""
    oldest = {"Python": newest["Python"], **floors()}
    head = HEADERS[lang]
    lines = [f"| {head[0]} | {head[1]} | {head[2]} |", "| --- | --- | --- |"]
    lines += [f"| {label} | {oldest[label]} | {newest[label]} |" for label, _ in TABLE]
    return "\n".join(lines) + "\n"


def read_table(text: str) -> dict[str, tuple[str, str]]:
    """The table's rows in a page: label -> (oldest, newest)."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m and m.group("name") in dict(TABLE):
            rows[m.group("name")] = (m.group("oldest"), m.group("newest"))
    return rows


def check(column: str, pages: tuple[Path, ...] = PAGES) -> list[str]:
    """How the pages' ``column`` ("oldest" or "newest") differs from this environment (empty when it matches).
    The oldest column's Python is not compared: scripts/test-floors.sh uses whatever Python runs it, CI's or not."""
    here = environment()
    problems = []
    for page in pages:
        rows = read_table(page.read_text(encoding="utf-8"))
        missing = [label for label, _ in TABLE if label not in rows]
        if missing:
            problems.append(f"{page.name}: the versions table has no row for {', '.join(missing)}")
        for label, (oldest, newest) in rows.items():
            if column == "oldest" and label == "Python":
                continue
            said = oldest if column == "oldest" else newest
            if said != here[label]:
                problems.append(f"{page.name}: {label} {said} in the {column!r} column, {here[label]} here")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        if len(argv) < 2 or argv[1] not in ("newest", "oldest"):
            print("usage: python scripts/versions.py --check newest|oldest [PAGE ...]", file=sys.stderr)
            return 2
        problems = check(argv[1], tuple(Path(p) for p in argv[2:]) or PAGES)
        for p in problems:
            print(f"versions.py: {p}", file=sys.stderr)
        if problems:
            fix = ("raise the floor in pyproject.toml and the table with it (python -m doctools.generated)"
                   if argv[1] == "oldest" else
                   "rewrite the table from this environment: python -m doctools.generated --versions")
            print(f"versions.py: the table no longer says what CI tests; {fix}", file=sys.stderr)
            return 1
        print(f"versions.py: the {argv[1]!r} column of the versions table is this environment's")
        return 0
    label = argv[0] if argv else "versions"
    print(f"{label}: Python {platform.python_version()} | " + ", ".join(f"{n} {installed(n)}" for n in NAMES))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
