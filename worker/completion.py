"""Tab completion and Shift-Tab inspection against a rank's namespace, answered by its I/O thread (the main thread
may be busy in a cell or stopped at a pdb prompt).

Completion uses the standard library's ``rlcompleter`` (names, keywords, builtins and ``obj.attr``: it evaluates
the dotted name before the last dot, as Python's own REPL does). Inspection looks a dotted name up attribute by
attribute, never evaluating other code, and describes it as IPython's ``?`` does: type, signature, docstring,
value.
"""

from __future__ import annotations

import inspect
import re
import rlcompleter
from typing import Any

from . import protocol as P

__all__ = ["complete", "describe", "answer", "MAX_MATCHES"]

MAX_MATCHES = 500
MAX_TEXT = 20_000  # characters of an inspection's text
_TOKEN = re.compile(r"[A-Za-z_][\w.]*$|$")
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def complete(namespace: dict, code: str, cursor_pos: int) -> tuple[list[str], int, int]:
    """Completions of the name ending at ``cursor_pos`` of ``code``: (matches, cursor_start, cursor_end)."""
    before = code[:cursor_pos]
    token = (_TOKEN.search(before) or _TOKEN.search("")).group(0)  # type: ignore[union-attr]
    start = cursor_pos - len(token)
    matches: list[str] = []
    for _attempt in range(3):  # the main thread may change the namespace meanwhile
        try:
            completer = rlcompleter.Completer(dict(namespace))
            matches = []
            state = 0
            while len(matches) < MAX_MATCHES:
                m = completer.complete(token, state)
                if m is None:
                    break
                matches.append(m.rstrip("(").rstrip())
                state += 1
            break
        except RuntimeError:
            continue
        except Exception:  # noqa: BLE001 - whatever an attribute lookup raises: no completions
            matches = []
            break
    return list(dict.fromkeys(matches)), start, cursor_pos


def _lookup(namespace: dict, name: str) -> tuple[bool, Any]:
    parts = name.split(".")
    if parts[0] in namespace:
        obj = namespace[parts[0]]
    else:
        import builtins

        if not hasattr(builtins, parts[0]):
            return False, None
        obj = getattr(builtins, parts[0])
    for part in parts[1:]:
        try:
            obj = getattr(obj, part)
        except Exception:  # noqa: BLE001
            return False, None
    return True, obj


def describe(namespace: dict, code: str, cursor_pos: int) -> str:
    """IPython-``?``-like text for the dotted name at ``cursor_pos`` of ``code`` ("" when it is not defined)."""
    name = ""
    for found in _NAME.finditer(code):
        if found.start() <= cursor_pos <= found.end():
            name = found.group(0)
            break
    if not name:
        # the name before an open parenthesis: f(|  -> f
        m = re.search(r"([A-Za-z_][\w.]*)\s*\(\s*[^()]*$", code[:cursor_pos])
        name = m.group(1) if m else ""
    if not name:
        return ""
    ok, obj = _lookup(namespace, name)
    if not ok:
        return ""
    lines = [f"Type:      {type(obj).__name__}"]
    if callable(obj):
        try:
            lines.append(f"Signature: {name.rsplit('.', 1)[-1]}{inspect.signature(obj)}")
        except (TypeError, ValueError):
            pass
    else:
        try:
            text = repr(obj)
        except Exception as e:  # noqa: BLE001
            text = f"<repr raised {type(e).__name__}>"
        lines.append(f"Value:     {text[:2000]}")
    doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
    if doc:
        lines.append(f"Docstring:\n{doc}")
    return "\n".join(lines)[:MAX_TEXT]


def answer(namespace: dict | None, msg: P.Complete) -> P.CompleteReply:
    """The reply to a ``Complete`` request (never raises)."""
    ns = namespace if namespace is not None else {}
    try:
        if msg.inspect:
            return P.CompleteReply(msg.request_id, text=describe(ns, msg.code, msg.cursor_pos))
        matches, start, end = complete(ns, msg.code, msg.cursor_pos)
        return P.CompleteReply(msg.request_id, matches, start, end)
    except Exception:  # noqa: BLE001 - the kernel falls back to its own completions
        return P.CompleteReply(msg.request_id, [], msg.cursor_pos, msg.cursor_pos)
