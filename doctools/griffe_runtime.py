"""A griffe extension for the API page: public classes that the code builds at run time.

``monarch_jupyter.lightning`` builds ``MeshStrategy``, ``MeshFabricStrategy``, ``MeshEnvironment`` and the
launchers on first access, inside the builder functions of ``strategies.py`` (as subclasses of the installed
Lightning's classes, so that loading the extension never imports Lightning). Static analysis sees only the module's
``__getattr__``. This extension reads those class definitions from the builders' source, as written, and adds them
to the module as griffe sees it, so that ``::: monarch_jupyter.lightning.MeshStrategy`` renders their docstrings
and signatures. Nothing is imported (the site builds without Lightning) and nothing in the code changes.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import griffe

# module as documented -> the file (beside its __init__.py) whose functions define its run-time classes
RUNTIME_CLASSES = {"monarch_jupyter.lightning": "strategies.py"}


def nested_classes(source: str) -> dict[str, str]:
    """Class name -> dedented source of every class defined inside a top-level function of ``source``."""
    tree = ast.parse(source)
    out = {}
    for func in tree.body:
        if isinstance(func, ast.FunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.ClassDef):
                    segment = ast.get_source_segment(source, node, padded=True) or ""
                    out[node.name] = textwrap.dedent(segment)
    return out


def public_names(init_source: str) -> list[str]:
    """The names in ``__all__`` of a module's source."""
    for node in ast.parse(init_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [str(v) for v in ast.literal_eval(node.value)]
    return []


class RuntimeClasses(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, agent: Any = None, **kwargs: Any) -> None:
        builders = RUNTIME_CLASSES.get(mod.path)
        if builders is None or mod.filepath is None or isinstance(mod.filepath, list):
            return
        folder = mod.filepath.parent
        path = folder / builders
        classes = nested_classes(path.read_text(encoding="utf-8"))
        wanted = [n for n in public_names(mod.filepath.read_text(encoding="utf-8"))
                  if n in classes and n not in mod.members]
        if not wanted:
            return
        visited = griffe.visit(f"{mod.path}._runtime", filepath=path, code="\n\n".join(classes[n] for n in wanted),
                               extensions=getattr(agent, "extensions", None),
                               docstring_parser=getattr(agent, "docstring_parser", None),
                               docstring_options=getattr(agent, "docstring_options", None))
        for name in wanted:
            mod.set_member(name, visited.members[name])
