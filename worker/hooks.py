"""Run a function on a module right after it is imported (now, if it already was), without importing it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["after_import"]

_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}
_finder: _Finder | None = None


def after_import(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` once module ``name`` is imported (at once if it is already); ``fn`` must not raise
    (what it raises is logged and dropped, so that the user's import still works)."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        _call(fn, module)
        return
    _hooks.setdefault(name, []).append(fn)
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


def _call(fn: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        fn(module)
    except Exception:  # noqa: BLE001 - never break the user's import
        log.debug("import hook on %s failed", module.__name__, exc_info=True)


class _Loader(importlib.abc.Loader):
    """Wraps a module's own loader: run the module, then the hooks."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        for fn in _hooks.pop(self.name, []):
            _call(fn, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds hooked modules with the other finders and hands back a spec whose loader runs the hooks."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None
