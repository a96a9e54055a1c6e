"""Processes the mesh starts never inherit the kernel's own debugger session.

When JupyterLab's debugger is switched on, ipykernel runs ``debugpy.listen`` in the kernel. debugpy (its vendored
pydevd) then patches every way of starting a process (``subprocess``'s ``fork_exec``, ``os.exec*``,
``os.posix_spawn``, ``os.fork``) so that a Python child is re-run under ``pydevd.py --client 127.0.0.1 --port N``
and connects back to the kernel's debug adapter, and it exports ``PYDEVD_*`` settings into ``os.environ``. A fork
server started that way imports torch under a tracer that attaches to the adapter (minutes, not seconds: "did not
import torch within 60 s"), and ranks forked from it inherit a half-set-up tracer (SIGABRT at the next cell).

The mesh's processes get the kernel's debugger only when asked (:mod:`monarch_jupyter.kernel.dap`), so they are
started here without either: ``spawn_unpatched()`` turns pydevd's argument patching off for the calling thread (its
own ``skip_subprocess_arg_patch``, thread-local), and ``without_debugger_env`` drops the variables debugpy and
pydevd export.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping

__all__ = ["DEBUGGER_ENV_PREFIXES", "spawn_unpatched", "without_debugger_env"]

# Prefixes of the variables debugpy and pydevd put into the debugged process's environment (PYDEVD_USE_FRAME_EVAL,
# PYDEVD_LOAD_NATIVE_LIB, DEBUGPY_RUNNING, ...). A user who wants one on the ranks sets it in the mesh's `env`.
DEBUGGER_ENV_PREFIXES = ("PYDEVD_", "DEBUGPY_")

# The pydevd module that patches process creation (present only once debugpy was started in this process).
_PYDEV_MONKEY = "_pydev_bundle.pydev_monkey"


def without_debugger_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the variables of DEBUGGER_ENV_PREFIXES."""
    return {k: v for k, v in env.items() if not k.startswith(DEBUGGER_ENV_PREFIXES)}


@contextlib.contextmanager
def spawn_unpatched() -> Iterator[None]:
    """Processes started by this thread inside the block are not re-run under the kernel's debugger.

    A no-op where debugpy was never started in this process (nothing imports it here).
    """
    monkey = sys.modules.get(_PYDEV_MONKEY)
    skip = getattr(monkey, "skip_subprocess_arg_patch", None)
    if skip is None:
        yield
        return
    with skip():
        yield
