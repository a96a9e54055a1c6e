"""Running an existing torchrun script on a rank, unchanged: ``%mesh run script.py args`` / ``%mesh run -m module``.

``run_script`` runs a file (``runpy.run_path``) or a module (``runpy.run_module``) as ``python script.py args``
and ``python -m module args`` would, which is what torchrun starts on each worker:

- ``__name__ == "__main__"``, ``sys.argv == [script, *args]`` with the script's absolute path, as its ``__file__``
  (``runpy.run_path`` sets ``argv[0]``; ``python script.py`` keeps it as typed: ``os.path.basename``, and so
  argparse's ``prog``, is the same), for a module its file, as ``python -m`` sets it;
- ``sys.path[0]`` is the script's folder (for a module: the working folder), as Python puts it there;
- the working folder is the notebook's, when it exists on this rank's host (where torchrun would be started);
- the script's own ``init_process_group`` and ``destroy_process_group`` meet the mesh's group (group.py);
- ``SystemExit(0)`` (or ``sys.exit()``) is success; ``SystemExit(n)`` raises ``ScriptExit`` with that status.

Each run starts with frameworks' state as a fresh process has it, its own environment variables, warnings and
logging, and gives them back afterwards (freshstate.py). Afterwards ``sys.argv``, ``sys.path``, the working
folder and ``__main__`` (the rank's namespace) are as before, and the modules the script imported from its own
folder are forgotten, so an edit of them shows in the next run as in a fresh torchrun process (torch and other
installed packages stay imported: that is the time saved).

Rank 0 prints ``NO_INIT_NOTE`` when the script ran collectives without ever asking for a process group: no call of
``init_process_group`` and no ``dist.is_initialized()`` from code outside torch (frameworks and careful scripts
call ``init_process_group`` only when that is False, which on the mesh it never is; they work under torchrun).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import sys
import sysconfig

from . import group as groups
from .freshstate import run_state
from .recovery import last_collective

__all__ = ["run_script", "ScriptExit", "ScriptNotFound", "NO_INIT_NOTE"]

NO_INIT_NOTE = ("monarch: {target} ran collectives without calling torch.distributed.init_process_group(); on the "
                "mesh they used the mesh's process group, but under torchrun they fail ('Default process group has "
                "not been initialized'). Call dist.init_process_group() in the script (it returns at once on the "
                "mesh).\n")


class ScriptExit(Exception):
    """The script exited with a non-zero status on this rank (``sys.exit(n)``, or a message, status 1)."""

    def __init__(self, target: str, status: int, message: str = "") -> None:
        self.target, self.status = target, status
        why = f": {message}" if message else ""
        super().__init__(f"{target} exited with status {status} on this rank{why} (under torchrun this worker would "
                         f"fail with exit code {status})")


class ScriptNotFound(FileNotFoundError):
    """The script's file does not exist on this rank's host."""


def run_script(target: str, args: list[str], module: bool = False, path: str = "", cwd: str = "",
               keep_state: bool = False, env: dict[str, str] | None = None) -> int:
    """Run ``target`` (a file, or with ``module`` a module name) with ``args`` as torchrun's worker would; returns
    0 when it ends or exits with status 0.

    ``path``: the file's absolute path as the notebook resolved it ("" for ``target`` as given); ``cwd``: the
    notebook's working folder (used when it exists here); ``env``: variables set for this run only;
    ``keep_state``: keep frameworks' state as the cells left it (freshstate.py).

    Raises
    ------
    ScriptExit
        It exited with a non-zero status.
    ScriptNotFound
        The file does not exist on this rank's host.
    ImportError
        ``module`` and no such module here.
    Exception
        Whatever the script raised.
    """
    saved_argv, saved_path, saved_cwd = list(sys.argv), list(sys.path), os.getcwd()
    before = set(sys.modules)
    group = groups.installed()
    init_calls = group.init_calls if group is not None else 0
    guard_calls = group.guard_calls if group is not None else 0
    collectives = last_collective()
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    path = "" if module else (path or os.path.abspath(target))
    origin = os.getcwd() if module else os.path.dirname(path)  # the folder the script's own modules come from
    try:
        with run_state(keep_state, env), (group.watch_guards() if group is not None else contextlib.nullcontext()):
            _run_target(target, args, module, path)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        try:
            os.chdir(saved_cwd)
        except OSError:
            pass
        _forget_modules(set(sys.modules) - before, origin)
    if (group is not None and group.rank == 0 and group.init_calls == init_calls
            and group.guard_calls == guard_calls and last_collective() != collectives):
        sys.stderr.write(NO_INIT_NOTE.format(target=target))
    return 0


def _run_target(target: str, args: list[str], module: bool, path: str) -> None:
    """Set argv and sys.path for ``target`` (``path``: the file's absolute path) and run it."""
    if module:
        sys.argv = [target, *args]  # runpy sets argv[0] to the module's file, as python -m does
        origin = os.getcwd()
        sys.path.insert(0, origin)
        try:
            spec = importlib.util.find_spec(target)
        except ImportError:  # a parent package that does not exist
            spec = None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {target!r} on this rank (looked in the working folder "
                                      f"{origin} and sys.path): check the name, or run the file with  %mesh run "
                                      "path/to/script.py", name=target)
        _run(lambda: runpy.run_module(target, run_name="__main__", alter_sys=True), target)
        return
    file = path
    if not os.path.isfile(file):
        raise ScriptNotFound(f"no script {target!r} on this rank's host ({file} does not exist; working "
                             f"folder {os.getcwd()}): give a path that exists where the ranks run")
    sys.argv = [file, *args]  # runpy.run_path sets argv[0] to the file it runs
    sys.path.insert(0, os.path.dirname(file))
    _run(lambda: runpy.run_path(file, run_name="__main__"), target)


def _run(body: object, target: str) -> None:
    try:
        body()  # type: ignore[operator]
    except SystemExit as e:
        code = e.code
        if code is None or code == 0:
            return
        if isinstance(code, int):
            raise ScriptExit(target, code) from None
        sys.stderr.write(f"{code}\n")  # Python prints a non-numeric exit message and exits with status 1
        raise ScriptExit(target, 1, str(code)) from None


def _forget_modules(names: set[str], origin: str) -> None:
    """Drop the modules the script imported from its own folder (not installed packages, not the stdlib)."""
    if not origin:
        return
    origin = os.path.join(os.path.abspath(origin), "")
    installed = {os.path.join(os.path.abspath(p), "") for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := sysconfig.get_paths().get(key))}
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None) or ""
        file = os.path.abspath(file) if file else ""
        if file.startswith(origin) and not any(file.startswith(p) for p in installed):
            sys.modules.pop(name, None)
