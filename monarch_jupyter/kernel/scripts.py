"""Running an existing torchrun script on the ranks: ``Mesh.run_script`` and ``%mesh run``.

The controller checks what it can before anything runs (the file exists, for ranks on this host; the arguments
are strings), then sends every chosen rank one call of ``monarch_worker.scripts.run_script`` (which runs the file
as ``python script.py args`` would, see that module), and waits for it like a cell: output streams live, labelled
per rank; an exception or a non-zero exit status on some ranks raises one ``MeshError`` (``ScriptExit`` for an
exit status), with the other ranks' exit statuses in its ``.results``. Each run starts with frameworks' state as a
fresh process has it and its own environment (``env``: variables for the run only), unless ``keep_state``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from monarch_worker import protocol as P
from monarch_worker import scripts as rank_scripts
from monarch_worker.serialize import dumps

from ..ranks import RankMap, parse_ranks
from .config import check_timeout
from .state import MeshState
from .waiting import Waiter

__all__ = ["run_script", "script_call", "script_env"]


def script_call(target: str | os.PathLike, args: Iterable[Any], module: bool, local: bool,
                keep_state: bool = False, env: Mapping[str, Any] | None = None) -> tuple:
    """The (function, args, kwargs) each rank calls for ``target``; checks what can be checked here.

    ``local``: the ranks run on this host (the file must exist here); ``keep_state``: keep frameworks' state as the
    cells left it; ``env``: environment variables for this run only (monarch_worker/freshstate.py).

    Raises
    ------
    FileNotFoundError
        ``local`` and the file does not exist (nothing runs).
    TypeError, ValueError
        ``target`` is empty, not a path or module name, an argument is not a string, a number or a path, or an
        ``env`` name is not a variable name.
    """
    if not isinstance(target, (str, os.PathLike)) or not os.fspath(target):
        raise ValueError(f"run_script needs a script path (or a module name with module=True), got {target!r}")
    target = os.fspath(target)
    argv = []
    for a in args:
        if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike)):
            raise TypeError(f"script arguments are command-line strings; got {a!r} ({type(a).__name__})")
        argv.append(os.fspath(a) if isinstance(a, os.PathLike) else str(a))
    cwd = os.getcwd()
    extra: dict[str, Any] = {"cwd": cwd, "keep_state": bool(keep_state), "env": script_env(env)}
    if module:
        if not all(part.isidentifier() for part in target.split(".")):
            raise ValueError(f"-m takes a module name like package.module, got {target!r}")
        return rank_scripts.run_script, (target, argv), {"module": True, **extra}
    path = os.path.abspath(target)
    if local and not os.path.isfile(path):
        where = "is a folder" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"no script {target!r}: {path} {where} (the notebook's working folder is {cwd}). "
                                "Give the path of a Python file, relative to that folder or absolute; for a module, "
                                "%mesh run -m package.module")
    return rank_scripts.run_script, (target, argv), {"path": path, **extra}


def script_env(env: Mapping[str, Any] | None) -> dict[str, str]:
    """``env`` as the strings a process environment holds.

    Raises
    ------
    TypeError, ValueError
        A name is not a variable name (letters, digits, underscores), or a value is not a string or a number.
    """
    out = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not name or not (name[0].isalpha() or name[0] == "_") or not all(
                c.isalnum() or c == "_" for c in name) or not name.isascii():
            raise ValueError(f"an environment variable name is letters, digits and underscores, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"environment variable {name} must be a string, got {value!r} ({type(value).__name__})")
        out[name] = str(value)
    return out


def run_script(state: MeshState, waiter: Waiter, target: str | os.PathLike, args: Iterable[Any], *, module: bool,
               local: bool, ranks: str | int | Iterable[int] | None, timeout: float | None,
               order: str, keep_state: bool = False, env: Mapping[str, Any] | None = None) -> RankMap:
    """Run ``target`` on ``ranks`` and wait (``timeout`` seconds, None: the mesh's cell timeout, if any); rank ->
    exit status (0). ``keep_state`` and ``env`` as for ``script_call``.

    Raises as ``script_call`` does before anything runs; then as ``Mesh.run``: MeshError (an exception or a
    non-zero exit status on some ranks), MeshTimeoutError, KeyboardInterrupt.
    """
    check_timeout(timeout)
    fn, args, kwargs = script_call(target, args, module, local, keep_state, env)
    chosen = parse_ranks(ranks, state.nproc)
    cell_id = next(state.ids)
    payload, buffers = dumps((fn, args, kwargs))
    what = f"the {'module' if module else 'script'} {os.fspath(target)}"
    handle = waiter.submit(cell_id, [(chosen, P.Call(cell_id, {}), payload, buffers)], what, order, timeout=timeout)
    result = waiter.result(handle.record, timeout if timeout is not None else (state.options.timeout or None))
    return result if result is not None else RankMap(dict.fromkeys(chosen, 0))
