"""``%load_ext monarch`` for monarch-jupyter: a one-file module, installed as ``monarch.py``.

PyTorch Monarch (``torchmonarch``) installs a package of the same name, the folder ``monarch/``. The two share
no file, so installing, upgrading or uninstalling either one never touches the other's files, and where both are
installed Python imports PyTorch Monarch's package (a package wins over a module in the same folder; the start-up
hook ``_monarch_jupyter_hook`` makes it win from any folder and gives it a ``load_ipython_extension`` when it has
none). This module is only what ``import monarch`` finds when no other ``monarch`` is installed.
``%load_ext monarch_jupyter`` loads the same extension under its own name, always.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    from monarch_jupyter import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from monarch_jupyter import unload_ipython_extension as unload

    unload(ipython)


def why_not_pytorch_monarch() -> str:
    """Why ``import monarch`` found this module rather than PyTorch Monarch, and the command that changes it."""
    try:
        from importlib.metadata import version

        installed = version("torchmonarch")
    except Exception:  # noqa: BLE001 - not installed (or unreadable): the plain case
        return ("this `monarch` is monarch-jupyter's one-file module for `%load_ext monarch`; PyTorch Monarch is "
                "not installed here. Fix: pip install torchmonarch")
    return (f"this `monarch` is monarch-jupyter's one-file module: torchmonarch {installed} is installed, but its "
            "monarch/__init__.py is gone (earlier monarch-jupyter builds shipped a file of that name, and "
            "replacing or uninstalling one took torchmonarch's away). "
            "Fix: pip install --force-reinstall --no-deps torchmonarch")


# Submodules (`import monarch.actor`) reach the finders, where the start-up hook explains them; there are none.
__path__: list[str] = []


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"module 'monarch' has no attribute {name!r}: {why_not_pytorch_monarch()}")
