"""The matplotlib backend of ranks (``module://monarch_worker.mpl_backend``: ``monarch_worker.display.install`` has
matplotlib use it when it is imported, unless the rank's environment names another backend in MPLBACKEND).

Figures draw on Agg canvases; ``plt.show()`` and the end of every cell show each open pyplot figure in the notebook
cell as a PNG and close it (``display.Publisher.flush_figures``), as IPython's inline backend (matplotlib_inline)
does in a kernel. Imported by matplotlib only, when a rank first uses pyplot.
"""

from __future__ import annotations

from typing import Any

from matplotlib.backend_bases import FigureManagerBase as FigureManager
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas

from . import display as _display

__all__ = ["FigureCanvas", "FigureManager", "show"]


def show(block: Any = None) -> None:
    """Show every open figure in the cell (PNG, one display each) and close them."""
    pub = _display.publisher()
    if pub is not None:
        pub.flush_figures()
