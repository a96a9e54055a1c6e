"""monarch_worker: the rank runtime of monarch_jupyter.

A GPU node needs only torch, cloudpickle and pyzmq to run a rank; this package never imports IPython,
ipywidgets or monarch_jupyter. Start a rank that joins a listening controller with ``python -m monarch_worker``.
"""

from __future__ import annotations

from .freshstate import reset_state
from .live import progress
from .reaper import keep_alive

__version__ = "0.1.0"

__all__ = ["__version__", "progress", "keep_alive", "reset_state"]
