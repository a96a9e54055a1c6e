"""What a fresh torchrun worker starts with, given back to a persistent rank for each ``%mesh run``.

A torchrun worker is a new process: frameworks' per-process state is empty, its environment is the launcher's,
its warnings show again. A rank lives on between runs, so ``run_state`` gives each run the same:

- **frameworks' per-process state** is reset before the run (``reset_state``): accelerate's ``AcceleratorState``,
  ``PartialState`` and ``GradientState`` (with accelerate's own ``_reset_state`` class methods) and Lightning's
  de-duplication caches of warnings (``WarningCache``, a ``set``: cleared). Lightning keeps nothing else between
  runs in a process (its rank is read from the environment, which is the same for every run of a rank; its seed
  lives in ``PL_GLOBAL_SEED``, restored with the environment). A module that was never imported is not imported:
  it has no state. After a run that ended well it is reset again, so the cells after it start as after a
  torchrun process that exited; after a failure it is kept for post-mortem (``%mesh debug``), and the next run
  resets it anyway;
- **the environment** (``os.environ``) is restored at the end to what it was at the start, so a variable the
  script sets (or ``env`` sets for the run) is gone afterwards, while what a cell set before the run stays;
- **warnings** filters are restored and "shown once" warnings show again in the next run
  (``warnings.catch_warnings``); the root logger's handlers and level are restored (``logging.basicConfig`` in
  the script configures again next time).

``keep_state`` keeps frameworks' state as the cells left it (no reset before or after), for a script meant to
use what cells made; the environment, warnings and logging are restored either way.

``reset_state()`` is the same reset for a cell (``monarch_worker.reset_state()``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping

__all__ = ["reset_state", "run_state"]

_LIGHTNING = ("lightning.", "pytorch_lightning.", "lightning_fabric.", "lightning_utilities.")


def reset_state() -> list[str]:
    """Reset the per-process state of the frameworks this process imported, as a fresh process has it; returns
    what was reset (names, for messages and tests). Objects made before (an ``Accelerator``) no longer work: make
    them again.

    Raises
    ------
    Exception
        Whatever accelerate's own reset raises (it does not, in the versions tested).
    """
    done = []
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)  # and PartialState
        state.GradientState._reset_state()
        done.append("accelerate")
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    cache_type = getattr(rank_zero, "WarningCache", None)
    if isinstance(cache_type, type):
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(_LIGHTNING):
                continue
            for value in list(vars(module).values()):
                if isinstance(value, cache_type):
                    value.clear()  # type: ignore[attr-defined]  # a set: Lightning's WarningCache
        done.append("lightning")
    return done


@contextlib.contextmanager
def run_state(keep_state: bool = False, env: Mapping[str, str] | None = None) -> Iterator[None]:
    """The block runs as a fresh torchrun worker would (see the module docstring), with ``env`` added to the
    environment for it.

    Raises
    ------
    Exception
        Whatever the block raises (the state is restored first, frameworks' state kept for post-mortem).
    """
    saved_env = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    if not keep_state:
        reset_state()
    ok = False
    try:
        os.environ.update(env or {})
        with warnings.catch_warnings():
            yield
        ok = True
    finally:
        if ok and not keep_state:
            reset_state()
        _restore_env(saved_env)
        root.handlers[:] = handlers
        root.setLevel(level)


def _restore_env(saved: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``saved`` again, touching only the variables that differ."""
    for name in [n for n in os.environ if n not in saved]:
        os.environ.pop(name, None)
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
