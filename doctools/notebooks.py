"""The tutorial notebooks in the site: English as stored, Chinese generated from a table of Markdown cells.

``notebooks/NAME.ipynb`` is copied to ``docs/notebooks/NAME.ipynb`` and ``docs/notebooks/NAME.zh.ipynb`` is made
from it with every Markdown cell replaced by its translation from ``docs/i18n/zh/notebooks/NAME.yml``, keyed by
cell id. Code cells and their stored outputs are untouched, so both pages show the same outputs, which nbval
compares in CI. Nothing is executed. Each translation records the hash of the English source it translates
(``en_sha``), so an English cell edited later shows up as stale in :func:`translation_problems`.

    python -m doctools.notebooks --skeleton NAME   # print a table for NAME, translations kept, stale ones marked
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "notebooks"
TABLES = ROOT / "docs" / "i18n" / "zh" / "notebooks"
OUT = ROOT / "docs" / "notebooks"  # generated, ignored by git


def tutorials() -> list[Path]:
    return sorted(SOURCE.glob("[0-9]*.ipynb"))


def source_text(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def sha(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def table_for(nb_path: Path) -> dict[str, Any]:
    path = TABLES / f"{nb_path.stem}.yml"
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {str(k): v for k, v in data.items()}  # keys are quoted in the files; an unquoted id may read as a number


def translation_problems(nb_path: Path) -> list[str]:
    """Markdown cells of the notebook without a current translation, and table entries no cell has."""
    nb, table = load(nb_path), table_for(nb_path)
    problems, seen = [], set()
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        cid = cell.get("id") or str(i)
        seen.add(cid)
        entry = table.get(cid)
        where = f"{nb_path.name} markdown cell {cid} (index {i})"
        if not entry or not str(entry.get("zh") or "").strip() or "# EN: " in str(entry.get("zh")):
            problems.append(f"{where}: no zh translation in {TABLES.relative_to(ROOT)}/{nb_path.stem}.yml")
        elif entry.get("en_sha") != sha(source_text(cell)):
            problems.append(f"{where}: the English cell changed since it was translated (en_sha "
                            f"{entry.get('en_sha')} != {sha(source_text(cell))}); update the translation")
    for cid in table:
        if cid not in seen:
            problems.append(f"{nb_path.name}: the table translates cell {cid}, which is not a Markdown cell")
    return problems


def translate(nb: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``nb`` with its Markdown cells in Chinese (English where no current translation exists)."""
    out = copy.deepcopy(nb)
    for i, cell in enumerate(out["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        entry = table.get(cell.get("id") or str(i))
        if entry and str(entry.get("zh") or "").strip() and entry.get("en_sha") == sha(source_text(cell)):
            cell["source"] = str(entry["zh"]).rstrip("\n")
    out.setdefault("metadata", {})["language_info"] = dict(out["metadata"].get("language_info") or {})
    return out


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def write_all(out: Path = OUT) -> list[Path]:
    """Write the English and Chinese notebooks for the site; returns the files written or kept."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    wanted = set()
    for nb_path in tutorials():
        nb = load(nb_path)
        en, zh = out / nb_path.name, out / f"{nb_path.stem}.zh.ipynb"
        _write_if_changed(en, nb_path.read_text(encoding="utf-8"))
        _write_if_changed(zh, json.dumps(translate(nb, table_for(nb_path)), ensure_ascii=False, indent=1) + "\n")
        written += [en, zh]
        wanted |= {en.name, zh.name}
    for stale in out.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    return written


def skeleton(nb_path: Path) -> str:
    nb, table = load(nb_path), table_for(nb_path)
    lines = [f"# Chinese Markdown cells of notebooks/{nb_path.name}, keyed by cell id.",
             "# en_sha: the English cell this translates (python -m doctools.notebooks --skeleton NAME).", ""]
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        cid = cell.get("id") or str(i)
        entry = table.get(cid) or {}
        current = entry.get("en_sha") == sha(source_text(cell))
        zh = str(entry.get("zh") or "").rstrip("\n")
        lines.append(f'"{cid}":')
        lines.append(f"  en_sha: {sha(source_text(cell))}" + ("" if current or not zh else "  # STALE: re-check"))
        lines.append("  zh: |")
        body = zh or "\n".join("# EN: " + ln for ln in source_text(cell).splitlines())
        lines += ["    " + ln if ln else "" for ln in body.splitlines()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--skeleton":
        print(skeleton(SOURCE / f"{sys.argv[2].removesuffix('.ipynb')}.ipynb"))
    else:
        problems = [p for nb in tutorials() for p in translation_problems(nb)]
        print("\n".join(problems) or "every Markdown cell has a current translation")
        sys.exit(1 if problems else 0)
