"""Hints added to a failed cell's error, from what the notebook knows and the ranks do not.

A ``%%mesh`` cell that uses a name the notebook defined but the ranks never got (a model made in an ordinary cell)
fails on each rank with a bare ``NameError``. ``name_hints`` tells the user, in the error's last lines, that the
name exists in the notebook and what sends it: ``%mesh push NAME`` for a value that can travel, "import it in
the cell" for a module, "create it in the cell" for a value that cannot be pickled. Nothing is sent by itself:
a push copies the value (a model's weights, a dataset), which only the user can decide.

The name comes from the rank's NameError message, as CPython words it (``name 'x' is not defined``); a message
worded otherwise gets no hint.
"""

from __future__ import annotations

import re
import types
from typing import Any

from ..errors import MeshError, RemoteError

__all__ = ["name_hints", "hint_for"]

_UNDEFINED = re.compile(r"^name '([A-Za-z_][A-Za-z0-9_]*)' is not defined")


def hint_for(name: str, value: Any) -> str:
    """What to tell about notebook variable ``name`` (holding ``value``) that the ranks do not have."""
    if isinstance(value, types.ModuleType):
        return (f"'{name}' is the module {value.__name__} in the notebook, not on the ranks: import it in the cell "
                f"(import {value.__name__}" + (f" as {name})" if name != value.__name__ else ")"))
    try:
        from monarch_worker.serialize import dumps

        dumps(value)
    except Exception as e:  # noqa: BLE001 - any reason it cannot travel
        return (f"'{name}' exists in the notebook but cannot be sent to the ranks ({type(e).__name__}: {e}); create "
                "it in a %%mesh cell instead")
    return (f"'{name}' exists in the notebook, not on the ranks: send it with  %mesh push {name}  "
            f"(mesh.push({name}={name}) in Python), or create it in a %%mesh cell")


def name_hints(error: MeshError, namespace: dict[str, Any]) -> None:
    """Add to ``error.hint`` a line for each NameError of its ranks whose name the notebook's ``namespace`` has."""
    lines: list[str] = []
    for err in error.errors.values():
        if not isinstance(err, RemoteError) or err.ename != "NameError":
            continue
        m = _UNDEFINED.match(err.evalue)
        if m is None or m.group(1) not in namespace:
            continue
        text = "hint: " + hint_for(m.group(1), namespace[m.group(1)])
        if text not in lines:
            lines.append(text)
    if lines:
        error.hint = "\n".join([*([error.hint] if error.hint else []), *lines])
