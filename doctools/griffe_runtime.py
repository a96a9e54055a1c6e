"""A griffe extension for the API page: public classes that exist only at run time.

``monarch_jupyter.lightning`` builds ``MeshStrategy``, ``MeshFabricStrategy``, ``MeshEnvironment`` and the
launchers on first access, as subclasses of the installed Lightning's classes, so that loading the extension never
imports Lightning. Static analysis sees only the module's ``__getattr__``. This extension imports them (Lightning
must be installed: ``pip install -e ".[docs,lightning]"``, which scripts/docs.sh does), inspects them with the
docstring parser and extensions of the page, and adds them to the module as griffe sees it, so that
``::: monarch_jupyter.lightning.MeshStrategy`` renders their docstrings and signatures. Nothing in the code changes.
"""

from __future__ import annotations

import importlib
from typing import Any

import griffe

RUNTIME_MODULES = ("monarch_jupyter.lightning",)


class RuntimeClasses(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, agent: Any = None, **kwargs: Any) -> None:
        if mod.path not in RUNTIME_MODULES:
            return
        try:
            module = importlib.import_module(mod.path)
            names = [n for n in getattr(module, "__all__", ()) if n not in mod.members]
            classes = {n: getattr(module, n) for n in names}
        except ImportError as e:
            raise ImportError(f"the API page documents {mod.path}, whose classes need Lightning: "
                              f"pip install -e '.[docs,lightning]' ({e})") from e
        classes = {n: c for n, c in classes.items() if isinstance(c, type)}
        for cls in classes.values():
            _own_names(cls)
        inspected: dict[str, griffe.Module] = {}
        for name, cls in classes.items():
            where = cls.__module__
            if where not in inspected:
                inspected[where] = griffe.inspect(
                    where, extensions=getattr(agent, "extensions", None),
                    docstring_parser=getattr(agent, "docstring_parser", None),
                    docstring_options=getattr(agent, "docstring_options", None))
            obj = inspected[where].members.get(name)
            if isinstance(obj, griffe.Class):
                mod.set_member(name, obj)


def _own_names(cls: type) -> None:
    """Give the functions of ``cls`` the module and qualified name of the class as it is published.

    The classes are defined inside a builder function, so their methods are named ``build_trainer.<locals>.
    MeshStrategy.__init__`` in ``strategies``; griffe's inspector takes a member named elsewhere for an alias of
    something it cannot find. Done in the docs build's own process only.
    """
    for attr, value in vars(cls).items():
        for fn in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
            if callable(fn) and "<locals>" in getattr(fn, "__qualname__", ""):
                fn.__qualname__ = f"{cls.__qualname__}.{attr}"
                fn.__module__ = cls.__module__
