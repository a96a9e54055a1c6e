"""Start-up hook that keeps ``%load_ext monarch`` working beside PyTorch Monarch; ``monarch_jupyter.pth`` imports it.

Two distributions provide the top-level name ``monarch``: monarch-jupyter's one-file module ``monarch.py`` (only
for ``%load_ext monarch``) and PyTorch Monarch's package ``monarch/`` (``torchmonarch``). They share no file, so
no install, upgrade or uninstall of either touches the other's files. This hook decides which one
``import monarch`` gets, the same way in every order of installing them:

- PyTorch Monarch's package (any ``monarch`` other than the ``monarch.py`` beside this file), wherever it is on
  ``sys.path``: this is its name, and its code must keep working. When that module has no
  ``load_ipython_extension``, the hook adds one (and ``unload_ipython_extension``) after the module ran, which
  loads monarch-jupyter and says why, so ``%load_ext monarch`` still works. When it cannot be imported, its error
  gets a note naming ``%load_ext monarch_jupyter``, which does not need it.
- Otherwise ``monarch.py`` beside this file; ``import monarch.<anything>`` then fails naming why this is not
  PyTorch Monarch and the command that fixes it (``monarch.why_not_pytorch_monarch``).

Python runs the ``.pth`` line at every start-up of every interpreter of the environment, so importing this module
only puts one finder first in ``sys.meta_path``; the finder acts on ``import monarch`` alone.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported at start-up: it would cost every interpreter of the environment
if TYPE_CHECKING:
    from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(_HERE, "monarch.py")

# Told when `%load_ext monarch` loads monarch-jupyter through another `monarch` package, and added to that
# package's import error.
USE_OWN_NAME = "`%load_ext monarch_jupyter` loads monarch-jupyter by its own name, whatever `monarch` is"


def _same(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def _is_shim(spec: Any) -> bool:
    origin = getattr(spec, "origin", None)
    return isinstance(origin, str) and _same(origin, SHIM)


def _other_monarch(path: list[str]) -> Any:
    """A spec for a ``monarch`` other than our shim on ``path`` (the other folders), or None."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("monarch", path)
    if spec is None or spec.origin is None or _is_shim(spec):  # nothing, or only a namespace portion
        return None
    return spec


def _describe(module: Any) -> str:
    where = getattr(module, "__file__", None) or ", ".join(getattr(module, "__path__", []) or ["?"])
    try:
        from importlib.metadata import packages_distributions

        dists = sorted(set(packages_distributions().get("monarch", [])) - {"monarch-jupyter", "monarch_jupyter"})
    except Exception:  # noqa: BLE001 - only for the message
        dists = []
    return f"{where}, from {', '.join(dists)}" if dists else where


def load_ipython_extension(ipython: Any) -> None:
    """Added to a ``monarch`` package that has none: load monarch-jupyter, saying why it goes this way."""
    print(f"note: `monarch` here is another package ({_describe(sys.modules.get('monarch'))}; PyTorch Monarch "
          f"installs one) with no IPython extension of its own, so `%load_ext monarch` loaded monarch-jupyter; "
          f"{USE_OWN_NAME}.", file=sys.stderr)
    from monarch_jupyter import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from monarch_jupyter import unload_ipython_extension as unload

    unload(ipython)


def _extend_on_exec(spec: Any) -> None:
    """Make ``spec``'s loader add our extension functions to the module after running it, if it has none."""
    loader = spec.loader
    exec_module = getattr(loader, "exec_module", None)
    if exec_module is None:
        return

    def exec_and_extend(module: Any) -> None:
        if getattr(module, "__name__", None) != "monarch":  # a loader shared with other modules
            exec_module(module)
            return
        try:
            exec_module(module)
        except Exception as e:
            e.add_note(f"(`import monarch` imports {spec.origin or 'a package'} here; {USE_OWN_NAME}.)")
            raise
        if not hasattr(module, "load_ipython_extension"):
            module.load_ipython_extension = load_ipython_extension
            module.unload_ipython_extension = unload_ipython_extension

    try:
        loader.exec_module = exec_and_extend  # this loader instance only; its class is untouched
    except (AttributeError, TypeError):
        pass


class MonarchFinder:
    """Meta path finder for the top-level name ``monarch``; first in ``sys.meta_path``, it asks the others."""

    monarch_jupyter_finder = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "monarch":
            parent = sys.modules.get("monarch") if fullname.startswith("monarch.") else None
            if parent is not None and _is_shim(getattr(parent, "__spec__", None)):
                raise ModuleNotFoundError(f"No module named {fullname!r}: {parent.why_not_pytorch_monarch()}",
                                          name=fullname)
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if getattr(finder, "monarch_jupyter_finder", False) or find is None:  # any copy of this finder
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        if _is_shim(spec):
            other = _other_monarch([p for p in sys.path if not _same(p or os.curdir, _HERE)])
            if other is None:
                return spec
            spec = other
        _extend_on_exec(spec)
        return spec

    def __repr__(self) -> str:
        return f"<{__name__}.MonarchFinder>"


def install() -> None:
    """Put one ``MonarchFinder`` first in ``sys.meta_path`` (idempotent)."""
    if not any(getattr(f, "monarch_jupyter_finder", False) for f in sys.meta_path):
        sys.meta_path.insert(0, MonarchFinder())


install()
