"""Shim so that ``%load_ext monarch`` loads monarch_jupyter.

If another distribution (PyTorch Monarch, ``torchmonarch``) also installs a ``monarch`` package, Python finds
one of the two first. Where theirs wins, ``%load_ext monarch`` fails inside their package; use
``%load_ext monarch_jupyter``, which always works. Where ours wins, their ``import monarch`` finds this shim,
and ``monarch_jupyter.magics`` says so when loading.
"""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    from monarch_jupyter import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from monarch_jupyter import unload_ipython_extension as unload

    unload(ipython)
