"""How a failed or interrupted job reads in the notebook: folded tracebacks, cells named as the notebook names them,
and the hint a ``strategy="ddp"`` Trainer gets in a notebook where a mesh runs.

- **Folding.** A one-line raise in ``training_step`` passes through some 30 frames of Lightning and torch (and the
  package's own job runner) before it reaches the user's code. ``FoldedRemoteError`` renders a rank's traceback with
  the user's frames as Python prints them and every run of other frames as one line that counts and names them
  (``[... 31 frames in lightning, torch: %mesh debug --rank 1 shows them]``). The innermost frames after the
  user's last one stay (where a library call raised); with no user frame at all, the innermost three stay.
  ``.traceback`` keeps the full text, and ``%mesh debug`` steps through every frame.
- **Cells.** Code defined in a notebook cell runs on the ranks under the file name ipykernel gave the cell
  (``/tmp/ipykernel_12/345.py``); tracebacks and interrupt reports say ``<cell In[3]>`` instead, as IPython's own
  tracebacks name it (``shell.compile.format_code_name``).
- **The ddp hint.** ``Trainer(strategy="ddp")`` (or ``Fabric``) in a notebook raises Lightning's advice to use
  ``ddp_notebook``; while a mesh runs, one more line (after the error) points to ``strategy="mesh"``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

import monarch_jupyter
import monarch_worker

from ..errors import RemoteError

__all__ = ["FoldedRemoteError", "fold_traceback", "cell_names", "name_cells", "install_ddp_hint", "ddp_hint",
           "KEEP_INNERMOST"]

KEEP_INNERMOST = 3
"""Frames kept after the user's last frame (where a library call raised), or at the end when there is none."""

_OURS = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
              for m in (monarch_jupyter, monarch_worker))
_LIBRARY_DIRS = tuple(sorted({p + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(k))}, key=len, reverse=True))


def _package(filename: str) -> str | None:
    """The package a frame's file belongs to ("lightning", "torch", "monarch_jupyter"), or None for the user's
    code (notebook cells, the user's own files)."""
    for ours in _OURS:
        if filename.startswith(ours):
            return os.path.basename(ours.rstrip(os.sep))
    if filename.startswith("<frozen "):
        return filename[len("<frozen "):].rstrip(">").split(".")[0]
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1].split(os.sep)[0].removesuffix(".py")
    for d in _LIBRARY_DIRS:
        if filename.startswith(d):
            return filename[len(d):].split(os.sep)[0].removesuffix(".py")
    return None


def _parse(text: str) -> list[tuple[str | None, list[str]]]:
    """A traceback's lines as items: (filename, lines) for a frame (its ``File`` line and the indented lines under
    it), (None, [line]) for anything else (headers, chained-exception separators, the exception itself)."""
    items: list[tuple[str | None, list[str]]] = []
    for line in text.splitlines():
        if line.startswith('  File "'):
            items.append((line[len('  File "'):].split('", line ', 1)[0], [line]))
        elif items and items[-1][0] is not None and line.startswith(("    ", "  [Previous")):
            items[-1][1].append(line)
        else:
            items.append((None, [line]))
    return items


def _fold_line(frames: list[str], rank: int | None) -> str:
    names: list[str] = []
    for filename in frames:
        name = _package(filename) or "other"
        if name not in names:
            names.append(name)
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    debug = "%mesh debug" + (f" --rank {rank}" if rank is not None else "")
    if len(frames) == 1:
        return f"  [... 1 frame in {shown}: {debug} shows it]"
    return f"  [... {len(frames)} frames in {shown}: {debug} shows them]"


def fold_traceback(text: str, rank: int | None = None) -> str:
    """``text`` (a formatted Python traceback) with each run of frames outside the user's code folded into one
    line; see the module docstring. A text that is not a traceback comes back as it is."""
    items = _parse(text)
    out: list[str] = []
    block: list[tuple[str, list[str]]] = []  # the frames of one exception of the chain

    def flush() -> None:
        user = [i for i, (filename, _) in enumerate(block) if _package(filename) is None]
        last = user[-1] if user else -1
        keep_from = max(last + 1, len(block) - KEEP_INNERMOST)
        run: list[tuple[str, list[str]]] = []

        def close() -> None:
            ours = any(filename.startswith(_OURS) for filename, _ in run)
            if len(run) > 1 or ours:  # one library frame takes no more room than its fold line
                out.append(_fold_line([filename for filename, _ in run], rank))
            else:
                out.extend(line for _, lines in run for line in lines)
            run.clear()

        for i, (filename, lines) in enumerate(block):
            if i in user or i >= keep_from:
                if run:
                    close()
                out.extend(lines)
            else:
                run.append((filename, lines))
        if run:
            close()
        block.clear()

    for filename, lines in items:
        if filename is None:
            flush()
            out.extend(lines)
        else:
            block.append((filename, lines))
    flush()
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


class FoldedRemoteError(RemoteError):
    """A rank's exception in a Lightning job, rendered with the frames outside the user's code folded
    (``fold_traceback``) and notebook cells named as the notebook names them. ``traceback`` is the full text."""

    def __init__(self, rank: int, ename: str, evalue: str, traceback: str = "", emodule: str = "",
                 frames: list | None = None, interrupted: bool = False, names: dict | None = None) -> None:
        super().__init__(rank, ename, evalue, traceback, emodule, frames, interrupted)
        self.names = dict(names or {})

    def __reduce__(self) -> tuple:
        return (type(self), (self.rank, self.ename, self.evalue, self.traceback, self.emodule, self.frames,
                             self.interrupted, self.names))

    @classmethod
    def of(cls, error: RemoteError, names: dict) -> FoldedRemoteError:
        """``error`` rendered folded, cells named by ``names`` (file name -> label, from ``cell_names``)."""
        return cls(error.rank, error.ename, error.evalue, error.traceback, error.emodule, error.frames,
                   error.interrupted, names)

    def render(self) -> list[str]:
        body = name_cells(fold_traceback(self.traceback, self.rank), self.names).rstrip("\n")
        body = body or f"{self.ename}: {self.evalue}"
        return [f"[rank{self.rank}] {line}" for line in body.splitlines()]


def cell_names(filenames: Any) -> dict[str, str]:
    """File name -> ``<cell In[N]>`` for those of ``filenames`` that are notebook cells of this kernel (IPython's
    ``compile.format_code_name``: the label its own tracebacks use); empty outside IPython."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    fmt = getattr(getattr(shell, "compile", None), "format_code_name", None)
    names = {}
    for filename in filenames or ():
        try:
            label = fmt(filename) if fmt is not None else None
        except Exception:  # noqa: BLE001 - a name only: the file name stays
            label = None
        if label:
            names[filename] = f"<{str(label[0]).lower()} {label[1]}>"
    return names


def name_cells(text: str, names: dict[str, str]) -> str:
    """``text`` with each notebook cell's file name replaced by its label (see ``cell_names``)."""
    for filename, label in names.items():
        text = text.replace(filename, label)
    return text


# ------------------------------------------------------------------------------------------------ the ddp hint

_INTERACTIVE = "is not compatible with an interactive environment"
_hinted: set[int] = set()


def ddp_hint(error: BaseException | None) -> str | None:
    """The line to add after Lightning's "not compatible with an interactive environment" error while a mesh
    runs, or None."""
    text = str(error or "")
    if _INTERACTIVE not in text or not text.startswith(("`Trainer(", "`Fabric(")):
        return None
    from ..errors import MeshNotRunningError
    from ..kernel import current_mesh

    try:
        mesh = current_mesh()
    except MeshNotRunningError:
        return None
    if not mesh.running:
        return None
    who = "Trainer" if text.startswith("`Trainer(") else "Fabric"
    return (f"monarch: a mesh of {mesh.world_size} ranks runs in this notebook: {who}(strategy=\"mesh\", "
            f"devices={mesh.world_size}) runs DDP on its ranks from this cell, without forking the kernel "
            "(docs/lightning.md)")


def _after_cell(result: Any) -> None:
    try:
        line = ddp_hint(getattr(result, "error_in_exec", None))
    except Exception:  # noqa: BLE001 - a hint only
        return
    if line:
        print(line, file=sys.stderr)


def install_ddp_hint() -> bool:
    """Add the ddp hint to this IPython shell (once; a ``post_run_cell`` event). Returns True when installed now;
    False outside IPython or when it already was."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or id(shell) in _hinted:
        return False
    shell.events.register("post_run_cell", _after_cell)
    _hinted.add(id(shell))
    return True
