"""Print one line: the Python and the versions of the packages the tested range in the README names.

    python scripts/versions.py LABEL
"""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version

NAMES = ["torch", "numpy", "ipython", "ipykernel", "jupyter_client", "jupyter_core", "pyzmq", "cloudpickle",
         "traitlets", "ipywidgets", "pytest", "setuptools"]


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


if __name__ == "__main__":
    label = sys.argv[1] if len(sys.argv) > 1 else "versions"
    print(f"{label}: Python {platform.python_version()} | " + ", ".join(f"{n} {installed(n)}" for n in NAMES))
