"""A cell's code before it is sent: compiled once in the kernel, and the notebook's functions and classes it uses.

``compile_cell`` raises a cell's SyntaxError here, before anything runs on a rank, and shows it as IPython shows a
syntax error (the offending line and its caret, not the controller's frames). ``notebook_refs`` finds the
functions and classes defined in the notebook (module ``__main__``) that the cell refers to: they travel with it,
by value, with their source for tracebacks (``sources_of``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import os
import traceback
from collections.abc import Iterable
from types import CodeType
from typing import Any

from monarch_worker.executor import expire_source, register_source

__all__ = ["compile_cell", "notebook_refs", "sources_of"]


def compile_cell(code: str, filename: str) -> CodeType:
    """Compile ``code`` under ``filename`` (registered in linecache, so tracebacks show its lines; the source of a
    cell that defines no function or class is dropped after ``monarch_worker.executor.KEPT_SOURCES`` newer ones).

    Raises
    ------
    TypeError
        ``code`` is not a str (a function: ``Mesh.call`` runs those).
    SyntaxError
        The code does not compile; IPython renders it as the line and a caret (``_render_traceback_``).
    """
    if not isinstance(code, str):
        raise TypeError(f"code is a cell's Python source (a str), got {type(code).__name__}"
                        + (": to call a function on the ranks, use mesh.call(fn, *args)" if callable(code) else ""))
    register_source(filename, code)
    try:
        compiled = compile(code, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        e._render_traceback_ = functools.partial(_render_syntax_error, e)  # type: ignore[attr-defined]
        raise e.with_traceback(None) from None
    expire_source(filename, compiled)  # the newest KEPT_SOURCES of the cells that define nothing callable
    return compiled


def _render_syntax_error(e: SyntaxError) -> list[str]:
    return "".join(traceback.format_exception_only(type(e), e)).rstrip("\n").splitlines()


def notebook_refs(code: str, namespace: dict[str, Any],
                  compiled: CodeType | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Functions and classes defined in the notebook (module __main__) that ``code`` refers to, and the source of
    the cells that define them.

    ``compiled`` (the code object of ``code``) lets most cells skip the syntax tree: its names, and those of the
    functions and classes it defines, are a superset of the names it loads.
    """
    if compiled is not None and not any(_notebook_defined(namespace.get(n)) for n in _code_names(compiled)):
        return {}, {}
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return {}, {}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    refs = {name: namespace[name] for name in names if _notebook_defined(namespace.get(name))}
    return refs, sources_of(refs.values())


def _notebook_defined(value: Any) -> bool:
    return (inspect.isfunction(value) or inspect.isclass(value)) and getattr(value, "__module__", None) == "__main__"


def _code_names(code: CodeType) -> set[str]:
    """Global and attribute names used by a code object and the code objects nested in it."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _code_names(const)
    return names


def sources_of(objs: Iterable[Any]) -> dict[str, str]:
    """Source text of the files that define ``objs`` when they are notebook cells (linecache entries)."""
    files: set[str] = set()
    for obj in objs:
        fns = [obj] if not inspect.isclass(obj) else [v for v in vars(obj).values() if inspect.isfunction(v)]
        for fn in fns:
            code = getattr(fn, "__code__", None)
            if code is not None:
                files.add(code.co_filename)
    sources = {}
    for filename in files:
        if os.path.exists(filename):
            continue  # a real file: the rank reads it itself
        lines = linecache.getlines(filename)
        if lines:
            sources[filename] = "".join(lines)
    return sources
