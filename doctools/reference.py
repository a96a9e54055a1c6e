"""The magics and configuration references, generated from the code at build time.

* Magics: every ``%mesh`` subcommand and ``%%mesh`` from the ``magic_arguments`` parsers of
  ``monarch_jupyter.magics`` (flags, argument, default, choices, help); ``%mesh inspect`` and ``%mesh auto``, which
  parse their line by hand, from their usage texts; ``%%local`` from its docstring.
* Configuration: :func:`config_rows` reads the option declarations. Today they are the configurable traits of
  ``MeshMagics``; when the options move to one declaration, only that function changes.

English help texts come from the code. Chinese ones come from ``docs/i18n/zh/reference.yml``, keyed by magic and
option ``dest`` (or option name), each entry holding the English text it translates (``en``) and the translation
(``zh``): :func:`translation_problems` lists entries that are missing or whose English changed since.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "i18n" / "zh" / "reference.yml"

LABELS = {
    "en": {"option": "Option", "argument": "Argument", "default": "Default", "help": "What it does",
           "name": "Option", "type": "Type", "usage": "Usage", "required": "required", "none": "none",
           "positional": "(positional)", "flag": "flag", "choices": "one of"},
    "zh": {"option": "选项", "argument": "参数", "default": "默认值", "help": "说明",
           "name": "配置项", "type": "类型", "usage": "用法", "required": "必填", "none": "无",
           "positional": "（位置参数）", "flag": "开关", "choices": "可选值"},
}


# ---------------------------------------------------------------------------------------------------- magics

@dataclass(frozen=True)
class OptionRow:
    key: str           # translation key: the argparse dest (or the option name for %mesh inspect)
    flags: str         # "-n, --nproc" or "names" (positional)
    argument: str      # "N", "{auto,gloo,nccl}", "" for a flag
    default: str       # repr-ish default, "" when none
    help: str          # English help text, as argparse prints it
    required: bool = False


@dataclass(frozen=True)
class MagicRow:
    name: str          # "%mesh start", "%%mesh"
    summary: str       # English one-line summary (from the docstring)
    usage: str         # synopsis (from the docstring)
    options: tuple[OptionRow, ...]


def _split_synopsis(doc: str) -> tuple[str, str]:
    """'%mesh start [-n N]: start N ranks' -> ('%mesh start [-n N]', 'start N ranks') (colon outside brackets)."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    depth = 0
    for i, ch in enumerate(first):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == ":" and depth == 0 and first[i + 1:i + 2] in (" ", ""):
            summary = first[i + 1:].strip()
            return first[:i].strip(), summary
    return first, ""


def _option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> OptionRow:
    formatter = parser._get_formatter()
    help_text = formatter._expand_help(action) if action.help else ""  # '%%mesh' -> '%mesh', as --help shows
    if action.option_strings:
        long_first = sorted(action.option_strings, key=lambda s: (not s.startswith("--"), s))
        flags = ", ".join(long_first)
    else:
        flags = action.dest
    if action.nargs == 0:
        argument = ""
    elif action.choices:
        argument = "{" + ",".join(map(str, action.choices)) + "}"
    elif action.option_strings:
        argument = action.metavar or action.dest.upper()
    else:
        argument = action.dest + (" ..." if action.nargs in ("+", "*", argparse.REMAINDER) else "")
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS) or (default == "" and action.option_strings):
        default_text = ""
    else:
        default_text = repr(default) if isinstance(default, str) else str(default)
    required = bool(action.required) or (not action.option_strings and action.nargs not in ("?", "*", argparse.REMAINDER))
    return OptionRow(action.dest, flags, argument, default_text, help_text, required)


def _parser_rows(func: Any) -> tuple[OptionRow, ...]:
    parser = func.parser
    return tuple(_option_row(parser, a) for a in parser._actions if not isinstance(a, argparse._HelpAction))


_USAGE_OPTION = re.compile(r"\s{2}(?P<flag>--?[\w-]+|[A-Za-z]+)(?:\s+(?P<arg>[A-Z]+))?(?:,\s*(?P<short>-\w)(?:\s+[A-Z]+)?)?"
                           r"\s{2,}(?P<text>\S.*)$")


def _usage_rows(usage: str) -> tuple[OptionRow, ...]:
    """Option rows of a magic that parses its line by hand and documents it in a usage text (``%mesh inspect``,
    ``%mesh auto``): one row per indented ``  FLAG [ARG][, -X]   help`` line."""
    rows = []
    for line in usage.splitlines():
        m = _USAGE_OPTION.match(line)
        if m:
            flag, arg, short, text = m.group("flag"), m.group("arg"), m.group("short"), m.group("text")
            flags = f"{flag}, {short}" if short else flag
            rows.append(OptionRow(flag.lstrip("-").lower(), flags, arg or "", "", text, "(required)" in text))
    return tuple(rows)


def _usage_row(name: str, usage: str, extra: tuple[OptionRow, ...] = ()) -> MagicRow:
    """A magic documented by a usage text: its synopsis line, a paragraph (the summary), its option lines."""
    para = [ln for ln in usage.split("\n\n")[1].splitlines() if not ln.startswith("  ")]
    return MagicRow(name, " ".join(" ".join(para).split()), usage.splitlines()[0], _usage_rows(usage) + extra)


def magic_rows() -> list[MagicRow]:
    """Every ``%mesh`` subcommand (in ``SUBCOMMANDS`` order), then ``%%mesh`` and ``%%local``."""
    import importlib
    import pkgutil

    from monarch_jupyter import magics
    from monarch_jupyter.magics import auto as auto_magics
    from monarch_jupyter.magics import debug as debug_magics

    # A subcommand's parser is MeshMagics._SUB or a function SUB of a module of monarch_jupyter.magics; the two
    # that parse their line by hand document it in a usage text instead.
    expr = OptionRow("expr", "EXPR", "EXPR", "", "a Python expression: the rest of the line, verbatim", True)
    by_hand = {"inspect": lambda: _usage_row("%mesh inspect", debug_magics.INSPECT_USAGE, (expr,)),
               "auto": lambda: _usage_row("%mesh auto", auto_magics.USAGE)}
    modules = [importlib.import_module(f"{magics.__name__}.{m.name}") for m in pkgutil.iter_modules(magics.__path__)]

    def find(sub: str) -> Any:
        candidates = [getattr(magics.MeshMagics, f"_{sub}", None), *(getattr(m, sub, None) for m in modules)]
        return next((c for c in candidates if c is not None and hasattr(c, "parser")), None)

    rows = []
    for sub in magics.SUBCOMMANDS:
        if sub in by_hand:
            rows.append(by_hand[sub]())
            continue
        func = find(sub)
        if func is None or not hasattr(func, "parser"):
            raise LookupError(f"%mesh {sub}: no magic_arguments parser found (MeshMagics._{sub}, or {sub} in a "
                              "module of monarch_jupyter.magics); update doctools/reference.py")
        usage, summary = _split_synopsis(func.parser.description or "")
        rows.append(MagicRow(f"%mesh {sub}", summary, usage, _parser_rows(func)))
    cell = magics.MeshMagics._cell
    usage, summary = _split_synopsis(cell.parser.description or "")
    rows.append(MagicRow("%%mesh", summary, usage, _parser_rows(cell)))
    usage, summary = _split_synopsis(magics.MeshMagics.local.__doc__ or "")
    rows.append(MagicRow("%%local", summary, usage, ()))
    return rows


# ---------------------------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class ConfigRow:
    key: str                 # translation key: the Mesh keyword, or the traitlet of a magics-only option
    name: str                # Mesh keyword ("" for an option of the magics only)
    trait: str               # MeshMagics traitlet ("" for none)
    default: Any
    unit: str
    rank: bool               # sent to ranks
    help: str                # English, as declared
    choices: tuple[str, ...]
    type: str


def config_rows() -> list[ConfigRow]:
    """Every option, in declaration order: the one place that knows where options are declared.

    Today: ``monarch_jupyter.kernel.config.options_table()``, which reads the declarations of
    ``monarch_worker/options.py`` (the same rows docs/configuration.md is generated from).
    """
    from monarch_jupyter.kernel.config import options_table

    return [ConfigRow(r["name"] or r["trait"], r["name"], r["trait"], r["default"], r["unit"], bool(r["rank"]),
                      " ".join(str(r["help"]).split()), tuple(r["choices"]), str(r["type"]))
            for r in options_table()]


# ---------------------------------------------------------------------------------------------------- zh table

def load_table(path: Path = TABLE) -> dict[str, Any]:
    if not path.exists():
        return {"magics": {}, "config": {}}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    data.setdefault("magics", {})
    data.setdefault("config", {})
    return data


def _entry(table: dict[str, Any], *keys: str) -> dict[str, str] | None:
    node: Any = table
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node if isinstance(node, dict) else None


def translation_problems(table: dict[str, Any] | None = None) -> list[str]:
    """Help texts without a current Chinese translation: missing, empty, or translating an older English text."""
    table = load_table() if table is None else table
    problems = []

    def check(where: str, english: str, entry: dict[str, str] | None) -> None:
        if not english:
            return
        if entry is None or not str(entry.get("zh") or "").strip():
            problems.append(f"{where}: no zh translation of {english!r}")
        elif " ".join(str(entry.get("en", "")).split()) != " ".join(english.split()):
            problems.append(f"{where}: the English text changed to {english!r} (the table translates "
                            f"{entry.get('en')!r}); update en and zh")

    for row in magic_rows():
        check(f"magics[{row.name!r}].summary", row.summary, _entry(table, "magics", row.name, "summary"))
        for opt in row.options:
            check(f"magics[{row.name!r}].options.{opt.key}", opt.help,
                  _entry(table, "magics", row.name, "options", opt.key))
    for crow in config_rows():
        check(f"config.{crow.key}", crow.help, _entry(table, "config", crow.key))
    return problems


def _zh(table: dict[str, Any], english: str, *keys: str) -> str:
    entry = _entry(table, *keys)
    if entry and str(entry.get("zh") or "").strip() and \
            " ".join(str(entry.get("en", "")).split()) == " ".join(english.split()):
        return str(entry["zh"]).strip()
    return english  # the parity test fails on this; the page stays complete meanwhile


# ---------------------------------------------------------------------------------------------------- Markdown

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def render_magics(lang: str = "en") -> str:
    """Markdown of every magic: a section each with its usage and a table of its options."""
    table = load_table() if lang != "en" else {}
    lab = LABELS[lang]
    out = []
    for row in magic_rows():
        summary = row.summary if lang == "en" else _zh(table, row.summary, "magics", row.name, "summary")
        out.append(f"### `{row.name}` {{#{_anchor(row.name)}}}\n")
        out.append(f"{summary}\n")
        out.append(f"```text\n{row.usage}\n```\n")
        if row.options:
            out.append(f"| {lab['option']} | {lab['argument']} | {lab['default']} | {lab['help']} |")
            out.append("|---|---|---|---|")
            for opt in row.options:
                text = opt.help if lang == "en" else _zh(table, opt.help, "magics", row.name, "options", opt.key)
                if opt.required:
                    text += f" ({lab['required']})"
                out.append(f"| {_code(_cell(opt.flags))} | {_code(_cell(opt.argument))} | "
                           f"{_code(_cell(opt.default))} | {_cell(text)} |")
            out.append("")
    return "\n".join(out) + "\n"


CONFIG_LABELS = {
    "en": {"mesh": ["`Mesh` keyword", "`MeshMagics` traitlet", "default", "unit", "sent to ranks", "what it does"],
           "magics": ["`MeshMagics` traitlet", "default", "unit", "what it does"],
           "yes": "yes", "one_of": " One of: {}.", "sep": ", ", "traitlet": " (traitlet: `{}`)", "units": {}},
    "zh": {"mesh": ["`Mesh` 关键字参数", "`MeshMagics` traitlet", "默认值", "单位", "发送给 rank", "说明"],
           "magics": ["`MeshMagics` traitlet", "默认值", "单位", "说明"],
           "yes": "是", "one_of": "可选值：{}。", "sep": "、", "traitlet": "（traitlet：`{}`）",
           "units": {"s": "秒", "ranks": "rank", "lines": "行"}},
}


def render_config(lang: str = "en", scope: str = "mesh") -> str:
    """Markdown table of the options of a mesh (``scope="mesh"``) or of the magics only (``"magics"``), in the
    shape of docs/configuration.md (which the code generates in English), with help texts in ``lang``."""
    table = load_table() if lang != "en" else {}
    lab = CONFIG_LABELS[lang]
    out = ["| " + " | ".join(lab[scope]) + " |", "| " + " | ".join(["---"] * len(lab[scope])) + " |"]
    for row in config_rows():
        if bool(row.name) != (scope == "mesh"):
            continue
        text = row.help if lang == "en" else _zh(table, row.help, "config", row.key)
        if row.choices:
            text += lab["one_of"].format(lab["sep"].join(row.choices))
        unit = lab["units"].get(row.unit, row.unit)
        default = f"`{row.default!r}`"
        if scope == "mesh":
            if row.trait and row.default is None:
                default += lab["traitlet"].format("0" if "float" in row.type else "''")
            trait = f"`{row.trait}`" if row.trait else ""
            out.append(f"| `{row.name}` | {trait} | {default} | {unit} | {lab['yes'] if row.rank else ''} | "
                       f"{_cell(text)} |")
        else:
            out.append(f"| `{row.trait}` | {default} | {unit} | {_cell(text)} |")
    return "\n".join(out) + "\n"


def skeleton() -> dict[str, Any]:
    """The translation table's shape for the current code, keeping existing translations (for translators)."""
    table = load_table()
    out: dict[str, Any] = {"magics": {}, "config": {}}
    for row in magic_rows():
        old = table["magics"].get(row.name, {})
        node: dict[str, Any] = {"summary": {"en": row.summary,
                                            "zh": (old.get("summary") or {}).get("zh", "")}, "options": {}}
        for opt in row.options:
            node["options"][opt.key] = {"en": opt.help,
                                        "zh": ((old.get("options") or {}).get(opt.key) or {}).get("zh", "")}
        out["magics"][row.name] = node
    for crow in config_rows():
        out["config"][crow.key] = {"en": crow.help, "zh": (table["config"].get(crow.key) or {}).get("zh", "")}
    return out


if __name__ == "__main__":  # python -m doctools.reference: print the table skeleton (translations kept)
    print(yaml.safe_dump(skeleton(), allow_unicode=True, sort_keys=False, width=1000))
