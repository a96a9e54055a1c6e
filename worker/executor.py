"""Running cells and calls in a rank's persistent namespace, and formatting what they raise."""

from __future__ import annotations

import ast
import builtins
import itertools
import linecache
import os
import sys
import threading
import traceback
import types
from collections import OrderedDict
from typing import Any

__all__ = ["Namespace", "MESH_NAMES", "KEPT_SOURCES", "register_source", "expire_source", "format_error",
           "main_thread_stack"]

#: The names every rank's namespace starts with (runtime.py binds them when the rank joins the mesh).
MESH_NAMES = ("rank", "world_size", "local_rank", "device", "dist", "torch")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LAST = "_monarch_last_value_"  # where a cell leaves the value of its last expression for a moment


KEPT_SOURCES = 1000
"""How many of the newest cells that define nothing able to run later keep their source in linecache
(``expire_source``); older ones are dropped. Without a bound a long session, or a loop of ``mesh.run`` calls, kept
every cell's text, about 800 bytes a cell in the kernel and in each rank (bench/soak.py: +4.9% RSS over 10,500
cells, most of the controller's growth)."""

_ONCE = ("<listcomp>", "<setcomp>", "<dictcomp>")  # nested code that runs within its cell and never after it
_expiring: OrderedDict[str, None] = OrderedDict()  # filenames whose source goes after KEPT_SOURCES newer ones
_expiring_lock = threading.Lock()  # the kernel compiles cells on several threads (sweeps, --async)


def register_source(filename: str, source: str) -> None:
    """Make ``source`` visible to linecache (tracebacks, pdb ``l``) under ``filename`` on this rank. It stays until
    ``expire_source`` says the cell defines nothing that can run later."""
    lines = source.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # mtime None: linecache.checkcache keeps the entry although no such file exists on disk.
    linecache.cache[filename] = (len(source), None, lines, filename)
    if _expiring:
        with _expiring_lock:
            _expiring.pop(filename, None)  # registered again: kept unless expire_source says otherwise again


def expire_source(filename: str, code: types.CodeType) -> None:
    """``code`` (compiled from ``filename``'s source) defines no function, class, lambda or generator: none of its
    code runs after the cell, so no later traceback, stack or pdb listing needs its lines once the cell is over.
    Its linecache entry is then one of the ``KEPT_SOURCES`` newest such entries, and the oldest beyond them is
    dropped. A cell that defines any of those keeps its source for the session, as IPython keeps its cells'."""
    if not _runs_only_now(code):
        return
    with _expiring_lock:
        _expiring[filename] = None
        _expiring.move_to_end(filename)
        while len(_expiring) > KEPT_SOURCES:
            old, _ = _expiring.popitem(last=False)
            linecache.cache.pop(old, None)


def _runs_only_now(code: types.CodeType) -> bool:
    """No code object nested in ``code`` can run after it returns (only list, set and dict comprehensions)."""
    return all(c.co_name in _ONCE and _runs_only_now(c) for c in code.co_consts if isinstance(c, types.CodeType))


def is_internal(filename: str) -> bool:
    """Frames of this runtime (and of runpy, which started it) are not shown to users."""
    return filename.startswith((_PACKAGE_DIR, "<frozen "))


def format_error(exc: BaseException, namespace: dict | None = None, interrupt_sent: bool = False) -> dict:
    """Describe ``exc`` for a Result: type, module, message and the traceback without our own frames.

    ``interrupted`` is True for a KeyboardInterrupt when ``interrupt_sent`` (an interrupt reached the cell); one
    the cell's own code raised is an exception like any other.

    ``namespace``: the rank's cell namespace; a NameError for one of its names, raised in a function defined in the
    notebook, gets a note saying why (see ``_note_notebook_globals``).
    """
    if namespace is not None:
        _note_notebook_globals(exc, namespace)
    tb = exc.__traceback__
    while tb is not None and is_internal(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    te = traceback.TracebackException(type(exc), exc, tb, compact=True)
    return {
        "type": type(exc).__qualname__,
        "module": type(exc).__module__,
        "message": str(exc),
        "traceback": "".join(te.format()),
        "interrupted": isinstance(exc, KeyboardInterrupt) and interrupt_sent,
        "frames": [_frame(f) for f in te.stack],
    }


def _note_notebook_globals(exc: BaseException, namespace: dict) -> None:
    """A function defined in the notebook runs on a rank with the notebook's globals (cloudpickle sends the ones
    it refers to along with it), not the rank's: a name only the rank has, such as ``rank``, is not found there.
    Add a note (PEP 678) that says so and what to do."""
    name = getattr(exc, "name", None)
    if not isinstance(exc, NameError) or not isinstance(name, str) or name not in namespace:
        return
    tb, frame = exc.__traceback__, None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    if frame is None or frame.f_globals is namespace or frame.f_globals.get("__name__") != "__main__":
        return
    func = frame.f_code.co_name
    exc.add_note(f"{name!r} is a name of this rank, but {func}() was defined in the notebook and looks names up "
                 f"in the notebook's globals, sent with it. Pass {name} as an argument, or define {func}() in a "
                 "%%mesh cell.")


def _frame(f: traceback.FrameSummary, positions: tuple | None = None) -> tuple[str, int, str, str, str]:
    """(filename, lineno, function, source line, the source of the instruction it runs). The last is the part of
    the line that Python 3.11's positions (PEP 657) name, "time.sleep(1)" in ``for i in r: time.sleep(1)``, or ""
    when it spans lines. ``positions``: (lineno, end_lineno, colno, end_colno) of a live frame's instruction (a
    traceback's frames carry theirs)."""
    line = (f.line or "").strip()
    if positions is None:
        positions = (f.lineno, getattr(f, "end_lineno", None), getattr(f, "colno", None),
                     getattr(f, "end_colno", None))
    lineno, end_lineno, colno, end = positions
    call = ""
    if colno is not None and end is not None and lineno == end_lineno == f.lineno:
        raw = linecache.getline(f.filename, f.lineno or 0).encode()  # the offsets count UTF-8 bytes
        call = raw[colno:end].decode(errors="replace").strip()
    return (f.filename, f.lineno or 0, f.name, line, call)


def _positions(frame: types.FrameType) -> tuple | None:
    """(lineno, end_lineno, colno, end_colno) of the instruction a live frame runs (``co_positions``, one entry
    per 2-byte code unit), or None."""
    if frame.f_lasti < 0:
        return None
    return next(itertools.islice(frame.f_code.co_positions(), frame.f_lasti // 2, None), None)


def main_thread_stack(frame: types.FrameType | None) -> list[tuple[str, int, str, str, str]]:
    """The user's part of a thread's stack (outermost first): (filename, lineno, function, source line, source of
    the running instruction; see ``_frame``)."""
    if frame is None:
        return []
    live = []
    while frame is not None:
        live.append(frame)
        frame = frame.f_back
    summary = traceback.extract_stack(live[0])  # outermost first, as ``reversed(live)``
    frames = [_frame(f, _positions(fr)) for f, fr in zip(summary, reversed(live), strict=True)]
    # Drop the runtime's own frames at the bottom (main loop, dispatch).
    while frames and is_internal(frames[0][0]):
        frames.pop(0)
    return frames


class Namespace:
    """A rank's persistent ``__main__`` namespace, where cells run.

    Classes and functions defined in cells belong to module ``__main__``, so cloudpickle sends them by value
    and the notebook can receive instances of them.
    """

    def __init__(self, initial: dict[str, Any]) -> None:
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = builtins
        module.__dict__.update(initial)
        sys.modules["__main__"] = module
        self.module = module
        self.ns = module.__dict__
        self._injected: dict[str, Any] = {}

    def inject(self, values: dict[str, Any] | None) -> None:
        """Bind notebook-defined functions/classes a cell refers to, unless the rank defined that name itself."""
        for name, value in (values or {}).items():
            if name not in self.ns or (name in self._injected and self.ns[name] is self._injected[name]):
                self.ns[name] = value
                self._injected[name] = value

    def run_cell(self, code: str, filename: str) -> tuple[bool, Any]:
        """Execute ``code``; returns (has_value, value of the last expression), like IPython's Out.

        Raises whatever the cell raises.
        """
        register_source(filename, code)
        tree = ast.parse(code, filename, "exec")
        has_value = bool(tree.body) and isinstance(tree.body[-1], ast.Expr)
        if has_value:
            # The last expression's value goes to a hidden name, in the same code object as the rest of the cell,
            # so that pdb steps onto that line like any other.
            last = tree.body[-1]
            assert isinstance(last, ast.Expr)
            tree.body[-1] = ast.copy_location(ast.Assign([ast.Name(_LAST, ast.Store())], last.value), last)
            ast.fix_missing_locations(tree)
        self.ns.pop(_LAST, None)
        compiled = compile(tree, filename, "exec")
        expire_source(filename, compiled)
        exec(compiled, self.ns)
        if not has_value:
            return False, None
        value = self.ns.pop(_LAST, None)
        if value is not None:
            self.ns["_"] = value
        return value is not None, value
