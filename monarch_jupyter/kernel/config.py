"""The options of a mesh as the notebook sees them, derived from their one declaration
(``monarch_worker.options``): MeshMagics traitlets, ``Mesh`` keyword arguments and ``mesh.<option>`` attributes,
and the table docs/configuration.md shows.

- ``traits()``: a traitlet for every option that has a trait name (``c.MeshMagics.cell_timeout = 60``).
- ``make_options(**kwargs)``: the ``MeshOptions`` of ``Mesh(nproc, **kwargs)``, checked, with an error that names
  the unknown keyword and the valid ones.
- ``OptionAttribute``: ``mesh.interrupt_grace = 2`` reads and sets ``mesh.options.interrupt_grace`` (checked).
- ``options_table()``: one row per option (name, trait, default, unit, help) for the docs.
- ``check_timeout(timeout)``: a call's ``timeout`` argument, checked before anything is sent.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from numbers import Real
from typing import Any

from traitlets import Bool, CaselessStrEnum, Float, Int, TraitType, Unicode

from monarch_worker.options import MeshOptions, NotebookOptions, check_value, option_fields

from ..errors import MeshStartError
from .launch.capacity import check_local_gpus

__all__ = ["MeshOptions", "NotebookOptions", "traits", "make_options", "OptionAttribute", "options_table",
           "mesh_signature", "trait_value", "check_timeout"]


def _trait(f: dataclasses.Field) -> TraitType:
    meta, kind, default = f.metadata, str(f.type), f.default
    assert default is not dataclasses.MISSING, f"option {f.name} with a traitlet needs a plain default"
    assert default is not dataclasses.MISSING, f"option {f.name} with a traitlet needs a plain default"
    unit = {"s": " (seconds)", "ranks": " (ranks)"}.get(meta["unit"], "")
    help_text = meta["help"] + unit
    if meta["choices"]:
        return CaselessStrEnum(list(meta["choices"]), default, help=help_text).tag(config=True)
    if "bool" in kind:
        return Bool(default, help=help_text).tag(config=True)
    if "float" in kind:
        return Float(0.0 if default is None else default, min=0.0, help=help_text).tag(config=True)
    if "int" in kind:  # numbers >= 0, as check_value takes them
        return Int(default, min=0, help=help_text).tag(config=True)
    return Unicode("" if default is None else default, help=help_text).tag(config=True)


def traits() -> dict[str, TraitType]:
    """MeshMagics traitlets: trait name -> traitlet, for every option declared with a trait name."""
    out = {}
    for cls in (MeshOptions, NotebookOptions):
        for f in option_fields(cls):
            if f.metadata["trait"]:
                out[f.metadata["trait"]] = _trait(f)
    return out


def trait_value(magics: Any, name: str) -> Any:
    """The MeshOptions value of option ``name`` as configured on ``magics`` (0 or "" -> None where the option
    takes None)."""
    f = next(f for f in option_fields(MeshOptions) if f.name == name)
    value = getattr(magics, f.metadata["trait"])
    if f.default is None and not value:
        return None
    return value


def make_options(**kwargs: Any) -> MeshOptions:
    """``MeshOptions(**kwargs)``, checked.

    Raises
    ------
    TypeError
        An unknown option (the message lists the valid ones).
    ValueError
        A value that does not fit its option.
    """
    names = {f.name for f in option_fields(MeshOptions)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"Mesh got unknown option(s) {', '.join(unknown)}; the options are: {', '.join(sorted(names))}")
    return MeshOptions(**kwargs).check()


class OptionAttribute:
    """``mesh.<option>``: the value of ``mesh.options.<option>``; setting it checks the value first."""

    def __init__(self, f: dataclasses.Field) -> None:
        self.field = f
        self.__doc__ = f.metadata["help"]

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.options, self.field.name)

    def __set__(self, obj: Any, value: Any) -> None:
        check_value(self.field, value)
        setattr(obj.options, self.field.name, value)


def add_option_attributes(cls: type) -> None:
    """Give ``cls`` (Mesh) one ``OptionAttribute`` per declared mesh option."""
    for f in option_fields(MeshOptions):
        if not hasattr(cls, f.name):  # ``mesh.address`` stays where ranks connect (the option: where to listen)
            setattr(cls, f.name, OptionAttribute(f))


def mesh_signature(init: Any) -> inspect.Signature:
    """The signature of ``init`` (Mesh.__init__) with ``**options`` spelled out as keyword-only parameters."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for f in option_fields(MeshOptions):
        default = {} if f.default is dataclasses.MISSING else f.default
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return sig.replace(parameters=params)


def options_table() -> list[dict[str, Any]]:
    """One row per option: name (Mesh keyword, or "" for magic-only), trait (MeshMagics), default, unit, help,
    choices, and whether ranks are sent it."""
    rows = []
    for cls, scope in ((MeshOptions, "mesh"), (NotebookOptions, "magics")):
        for f in option_fields(cls):
            default = {} if f.default is dataclasses.MISSING else f.default
            rows.append({"name": f.name if scope == "mesh" else "", "trait": f.metadata["trait"], "default": default,
                         "unit": f.metadata["unit"], "help": f.metadata["help"], "choices": f.metadata["choices"],
                         "rank": bool(f.metadata["rank"]), "type": str(f.type)})
    return rows


def options_markdown() -> str:
    """docs/configuration.md, generated from the declarations (tests/unit/test_options.py checks it is current)."""

    def default_text(row: dict[str, Any]) -> str:
        value = row["default"]
        text = f"`{value!r}`"
        if row["trait"] and value is None:
            text += " (traitlet: `0`)" if "float" in row["type"] else " (traitlet: `''`)"
        return text

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from monarch_worker/options.py: python -c 'from monarch_jupyter.kernel.config import "
        "options_markdown as m; print(m(), end=\"\")' > docs/configuration.md (tests/unit/test_options.py checks "
        "it) -->",
        "",
        "Every option is declared once, in `monarch_worker/options.py`, with its type, default, unit and help; the",
        "rest is derived from that declaration:",
        "",
        "- **`Mesh(...)` keyword arguments** and attributes: `Mesh(4, start_timeout=120)`, `mesh.interrupt_grace = 2`.",
        "- **`MeshMagics` traitlets**: `%config MeshMagics.cell_timeout = 60` in a notebook, or",
        "  `c.MeshMagics.cell_timeout = 60` in `ipython_config.py`; `%mesh start` passes them to `Mesh`.",
        "- **What ranks are sent** (the fields of `monarch_worker.config.RankConfig`, at start or in the handshake of",
        "  a rank that joined): the options marked \"sent to ranks\".",
        "",
        "Times are in seconds.",
        "",
        "## Options of a mesh",
        "",
        "| `Mesh` keyword | `MeshMagics` traitlet | default | unit | sent to ranks | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows = options_table()
    for row in rows:
        if not row["name"]:
            continue
        choices = f" One of: {', '.join(row['choices'])}." if row["choices"] else ""
        lines.append(f"| `{row['name']}` | {('`' + row['trait'] + '`') if row['trait'] else ''} | {default_text(row)} "
                     f"| {row['unit']} | {'yes' if row['rank'] else ''} | {row['help']}{choices} |")
    lines += ["", "## Options of the magics", "", "| `MeshMagics` traitlet | default | unit | what it does |",
              "| --- | --- | --- | --- |"]
    for row in rows:
        if row["name"]:
            continue
        choices = f" One of: {', '.join(row['choices'])}." if row["choices"] else ""
        lines.append(f"| `{row['trait']}` | `{row['default']!r}` | {row['unit']} | {row['help']}{choices} |")
    lines += ["", "Ranks that join from other hosts read the environment variables listed in docs/multihost.md.", ""]
    return "\n".join(lines)


def check_gpus(nproc: int) -> None:
    """Raise MeshStartError when the nccl backend cannot have one CUDA device per rank (launch.capacity)."""
    try:
        check_local_gpus(nproc)
    except ValueError as e:
        raise MeshStartError(str(e)) from None


def check_timeout(timeout: Any, name: str = "timeout", *, zero: bool = False) -> float | None:
    """A call's ``timeout`` in seconds, checked before anything is sent: None (no limit) or a number above 0
    (``zero``: 0 too, which looks once without waiting: ``handle.wait(0)``).

    Raises
    ------
    TypeError
        Not a number (a string such as "5", a bool).
    ValueError
        0 (unless ``zero``), negative, infinite or NaN: pass None for no limit.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise TypeError(f"{name} is a number of seconds, or None for no limit; got {timeout!r} "
                        f"({type(timeout).__name__})")
    value = float(timeout)
    if math.isinf(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {timeout!r}; pass None for no limit")
    if not value >= 0 or (value == 0 and not zero):  # NaN too
        least = "0 or more" if zero else "above 0"
        raise ValueError(f"{name} must be {least} seconds, got {timeout!r}; pass None for no limit")
    return value
