"""Auto mode: ``%mesh auto`` runs every following cell on the mesh without ``%%mesh``; ``%%local`` runs one cell
in the kernel; ``%mesh auto off`` ends it.

An IPython input transformer (``shell.input_transformers_cleanup``, which sees a cell's raw lines first) puts
``%%mesh`` in front of each cell while the mode is on. Cells that start with a magic (``%mesh status``,
``%%local``, ``%%time``), a shell escape (``!ls``) or a help request (``x?``) are left alone: magics always run in
the kernel. The mode is per shell, shown in ``%mesh status`` and in each cell's live view title.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

__all__ = ["AutoMode", "PREFIX"]

PREFIX = "%%mesh"


class AutoMode:
    """The auto mode of one shell (see the module docstring)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.on = False
        self.line = ""  # %%mesh options every auto cell gets (``%mesh auto --ranks 0``)
        self._bypass = 0  # > 0 while %%local runs its cell

    def transform(self, lines: list[str]) -> list[str]:
        """The input transformer: ``%%mesh`` in front of a cell of code while the mode is on."""
        if not self.on or self._bypass:
            return lines
        first = next((line for line in lines if line.strip()), None)
        if first is None:
            return lines
        head = first.lstrip()
        if head.startswith(("%", "!", "?")) or first.rstrip().endswith("?"):
            return lines
        return [f"{PREFIX} {self.line}".rstrip() + "\n", *lines]

    def install(self) -> None:
        cleanup = self.shell.input_transformers_cleanup
        if self.transform not in cleanup:
            cleanup.append(self.transform)

    def uninstall(self) -> None:
        cleanup = getattr(self.shell, "input_transformers_cleanup", [])
        if self.transform in cleanup:
            cleanup.remove(self.transform)

    def command(self, rest: str) -> None:
        """``%mesh auto [on|off] [%%mesh options]``: switch the mode (no argument: on)."""
        words = rest.split(None, 1)
        what = words[0] if words else "on"
        if what not in ("on", "off"):
            if what.startswith("-"):  # %mesh auto --ranks 0: on, with those options
                what, words = "on", ["on", rest]
            else:
                raise UsageError(f"%mesh auto takes on or off (and %%mesh options after on), got {what!r}; e.g. "
                                 "%mesh auto  or  %mesh auto on --ranks 0  or  %mesh auto off")
        if what == "off":
            was, self.on, self.line = self.on, False, ""
            print("auto mode off: cells run in the kernel" if was else "auto mode was not on")
            return
        self.line = words[1].strip() if len(words) > 1 else ""
        self.on = True
        opts = f" with  %%mesh {self.line}" if self.line else ""
        print(f"auto mode on: every cell runs on the mesh{opts}; magics run in the kernel, %%local runs one cell "
              "in the kernel, %mesh auto off ends it")

    def status(self) -> str:
        """"auto mode: on (%%mesh --ranks 0)" or "auto mode: off"."""
        if not self.on:
            return "auto mode: off"
        return f"auto mode: on ({PREFIX} {self.line})" if self.line else "auto mode: on"

    def run_local(self, cell: str) -> Any:
        """``%%local``: run ``cell`` in the kernel as a cell (its last expression is shown), auto mode or not."""
        self._bypass += 1
        try:
            self.shell.run_cell(cell, store_history=False)
        finally:
            self._bypass -= 1
        return None
