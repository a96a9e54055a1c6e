"""Rich output from a rank: ``display()``, ``update_display()``, ``clear_output()`` and matplotlib figures.

A rank has no IPython shell, so it has its own display publisher. ``display(obj)`` computes the object's MIME
bundle here, on the rank (``_repr_mimebundle_``, ``_repr_html_``, ``_repr_png_``, ... and ``repr``), and sends it
to the notebook as a ``Display`` message, which the kernel republishes as display_data in the cell that caused
it, labelled with the rank. Cells find ``display``, ``update_display`` and ``clear_output`` in their namespace;
``from IPython.display import display, HTML`` works too where IPython is installed on the rank: when (and if) a
cell imports IPython's display functions, they are replaced by these (this module never imports IPython).

How a bundle travels (``Publisher.send``): text stays text; binary types (image/png, image/jpeg, ...) travel as
raw bytes, never base64. A bundle of up to ``RECORD_MAX`` bytes from a local rank's main thread is a record in its
stdout pipe, in order with the cell's output; a larger one has its bytes in a shared memory segment (the transfer
path) and only the small message goes through the pipe; a rank on another host sends buffers over its socket.

Matplotlib: a rank uses the backend ``module://monarch_worker.mpl_backend`` unless its environment names another
(``MPLBACKEND``; the kernel's matplotlib_inline, inherited from ipykernel, is replaced): ``plt.show()`` and the end
of each cell show every open pyplot figure as a PNG, then close it, as IPython's inline backend does. A figure
that is a cell's last value comes back as a ``FigureImage`` (its PNG and its repr) instead of the figure.

Limits (each ends with a note in the cell, never a hang): at most ``MAX_PER_CELL`` display messages per rank and
cell, at most ``MAX_BYTES`` bytes per bundle; a repr that raises is left out (the note names it).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

from . import protocol as P

log = logging.getLogger(__name__)

__all__ = ["display", "update_display", "clear_output", "mime_bundle", "Publisher", "FigureImage", "install",
           "BACKEND", "RECORD_MAX", "MAX_BYTES", "MAX_PER_CELL", "BINARY_TYPES"]

BACKEND = "module://monarch_worker.mpl_backend"
RECORD_MAX = 64 * 1024
"""Bundles up to this many bytes go as records in a local rank's stdout pipe; larger ones through shared memory."""
MAX_BYTES = 32 * 1024 * 1024
"""Largest bundle (bytes, raw) a rank sends; a larger one is replaced by a note saying how large it was."""
MAX_PER_CELL = 1000
"""Display messages one rank sends per cell; past that they are counted and the cell gets one note at its end."""
BINARY_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf")

# repr methods, in IPython's order, and the MIME type each gives
_REPR_METHODS = (
    ("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"), ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"), ("application/pdf", "_repr_pdf_"), ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"), ("application/json", "_repr_json_"), ("application/javascript",
                                                                          "_repr_javascript_"),
)


class FigureImage:
    """A matplotlib figure as it came back from a rank: its PNG bytes and its repr (what a cell's last value that
    was a figure becomes, so the figure itself, maybe unpicklable and large, stays on the rank)."""

    def __init__(self, png: bytes, text: str) -> None:
        self.png, self.text = png, text

    def _repr_png_(self) -> bytes:
        return self.png

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FigureImage) and other.png == self.png and other.text == self.text

    __hash__ = None  # type: ignore[assignment]


def _is_figure(obj: Any) -> bool:
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


def _figure_png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _safe_repr(obj: Any, notes: list[str]) -> str:
    try:
        return repr(obj)
    except Exception as e:  # noqa: BLE001 - a broken repr must not break the cell
        notes.append(f"repr() of {type(obj).__name__} raised {type(e).__name__}: {e}")
        return f"<{type(obj).__name__} object (its repr raised {type(e).__name__})>"


def mime_bundle(obj: Any, include: Any = None, exclude: Any = None) -> tuple[dict, dict, list[str]]:
    """The MIME bundle of ``obj`` as IPython's formatters would make it: (data, metadata, notes).

    ``data`` maps MIME types to str (text), bytes (binary types) or JSON values; ``notes`` says which repr methods
    raised (they are left out; ``text/plain`` always exists).
    """
    data: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    notes: list[str] = []
    if _is_figure(obj):
        try:
            data["image/png"] = _figure_png(obj)
        except Exception as e:  # noqa: BLE001
            notes.append(f"rendering the figure raised {type(e).__name__}: {e}")
        data["text/plain"] = _safe_repr(obj, notes)
        return data, metadata, notes
    method = getattr(type(obj), "_repr_mimebundle_", None)
    if method is not None:
        try:
            got = obj._repr_mimebundle_(include=include, exclude=exclude)
            if isinstance(got, tuple):
                got, md = got
                metadata.update(md or {})
            data.update(got or {})
        except Exception as e:  # noqa: BLE001
            notes.append(f"_repr_mimebundle_ of {type(obj).__name__} raised {type(e).__name__}: {e}")
    for mime, name in _REPR_METHODS:
        if mime in data or getattr(type(obj), name, None) is None:
            continue
        try:
            value = getattr(obj, name)()
        except Exception as e:  # noqa: BLE001
            notes.append(f"{name} of {type(obj).__name__} raised {type(e).__name__}: {e}")
            continue
        if isinstance(value, tuple) and len(value) == 2:
            value, md = value
            if md:
                metadata[mime] = md
        if value is not None:
            data[mime] = value
    if "text/plain" not in data:
        data["text/plain"] = _safe_repr(obj, notes)
    if include:
        data = {k: v for k, v in data.items() if k in include or k == "text/plain"}
    if exclude:
        data = {k: v for k, v in data.items() if k not in exclude}
    return data, metadata, notes


def _as_bytes(mime: str, value: Any) -> bytes:
    """Raw bytes of a binary MIME value (bytes as is; a str is base64, as IPython's Image gives it)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    try:
        return base64.b64decode(str(value), validate=False)
    except (binascii.Error, ValueError):
        return str(value).encode()


class Publisher:
    """Sends a rank's displays to the controller (see the module docstring for the routes).

    ``send(msg, buffers)`` queues or writes a message (the rank's ``send``); ``current_cell()`` is the cell the
    main thread runs (-1: none); ``pool()`` gives the shared memory pool, or None where there is none.
    """

    def __init__(self, send: Callable[[P.Message, list], None], current_cell: Callable[[], int],
                 pool: Callable[[], Any] | None = None, records: Callable[[], bool] | None = None) -> None:
        self._send = send
        self._current_cell = current_cell
        self._pool = pool
        self._records = records or (lambda: False)
        self._lock = threading.Lock()
        self._count: dict[int, int] = {}
        self._dropped: dict[int, int] = {}
        self.figures_shown: set[int] = set()  # id() of figures displayed in this cell (not shown again at its end)

    # ---- what cells call

    def display(self, *objs: Any, raw: bool = False, include: Any = None, exclude: Any = None,
                metadata: dict | None = None, transient: dict | None = None, display_id: Any = None,
                clear: bool = False, **kwargs: Any) -> Any:
        """``IPython.display.display`` on a rank: each object becomes one display in the notebook cell.

        ``raw=True`` takes each object as a ready MIME bundle (dict). ``display_id=True`` makes a new id; with an
        id, the return value is a ``DisplayHandle`` (``update(obj)``, ``display(obj)``).
        """
        if transient and not display_id:
            display_id = transient.get("display_id", "")
        if display_id is True:
            display_id = uuid.uuid4().hex
        if clear:
            self.clear_output(wait=True)
        for obj in objs:
            self._publish("display", obj, raw, include, exclude, metadata, str(display_id or ""))
        if display_id:
            return DisplayHandle(self, str(display_id))
        return None

    def update_display(self, obj: Any, *, display_id: str, raw: bool = False, include: Any = None,
                       exclude: Any = None, metadata: dict | None = None, **kwargs: Any) -> None:
        """Replace what display ``display_id`` shows (``IPython.display.update_display`` on a rank)."""
        self._publish("update", obj, raw, include, exclude, metadata, str(display_id))

    def clear_output(self, wait: bool = False) -> None:
        """Clear the cell's output (``wait``: when the next output comes); ``IPython.display.clear_output``."""
        cell = self._current_cell()
        if self._admit(cell):
            self._send(P.Display(cell, "clear", wait=bool(wait)), [])

    # ---- internals

    def _admit(self, cell: int) -> bool:
        with self._lock:
            n = self._count.get(cell, 0) + 1
            self._count[cell] = n
            if n <= MAX_PER_CELL:
                return True
            self._dropped[cell] = self._dropped.get(cell, 0) + 1
            return False

    def _publish(self, kind: str, obj: Any, raw: bool, include: Any, exclude: Any, metadata: dict | None,
                 display_id: str, cell: int | None = None) -> None:
        if cell is None:
            cell = self._current_cell()
        md: dict[str, Any]
        notes: list[str]
        if raw and isinstance(obj, dict):
            data, md, notes = dict(obj), {}, []
        else:
            data, md, notes = mime_bundle(obj, include, exclude)
            if _is_figure(obj):
                self.figures_shown.add(id(obj))
        if metadata:
            md.update(metadata)
        for note in notes:
            sys.stderr.write(f"display: {note}; left out of the display\n")
        if self._admit(cell):
            self.send_bundle(cell, kind, data, md, display_id)

    def send_bundle(self, cell: int, kind: str, data: dict, metadata: dict, display_id: str = "") -> None:
        """Pack one bundle and send it by the cheapest route that keeps its bytes raw."""
        text: dict[str, str] = {}
        json_types: list[str] = []
        binary: list[str] = []
        buffers: list[bytes] = []
        for mime, value in data.items():
            if mime in BINARY_TYPES:
                binary.append(mime)
                buffers.append(_as_bytes(mime, value))
            elif isinstance(value, str):
                text[mime] = value
            else:
                try:
                    text[mime] = json.dumps(value)
                except (TypeError, ValueError):
                    text[mime] = str(value)
                    continue
                json_types.append(mime)
        try:
            md = json.dumps(metadata or {})
        except (TypeError, ValueError):
            md = "{}"
        size = sum(len(b) for b in buffers) + sum(len(t) for t in text.values())
        if size > MAX_BYTES:
            kinds = ", ".join(data)
            note = (f"a display of {size:,} bytes ({kinds}) was not sent: the limit is {MAX_BYTES:,} bytes per "
                    "display. Save it to a file, or show a smaller version (fewer pixels, dpi=).")
            text, json_types, binary, buffers, md = {"text/plain": note}, [], [], [], "{}"
            sys.stderr.write(f"display: {note}\n")
        msg = P.Display(cell, kind, text, json_types, binary, md, display_id)
        if size > RECORD_MAX and buffers and self._records() and self._pool is not None:
            seg_msg = self._through_shm(msg, buffers)
            if seg_msg is not None:
                self._send(seg_msg, [])
                return
        self._send(msg, buffers)

    def _through_shm(self, msg: P.Display, buffers: list[bytes]) -> P.Display | None:
        from . import shm
        from .transfer import CONTROLLER

        if not shm.supported() or self._pool is None:
            return None
        pool = self._pool()
        layout, total = shm.layout_of(len(b) for b in buffers)
        try:
            seg = pool.acquire(total)
            try:
                seg.write(buffers, layout)
            except BaseException:
                seg.close()
                raise
        except shm.ShmError as e:
            log.info("display goes over the socket, not through shared memory: %s", e)
            return None
        pool.lend(seg, [CONTROLLER])
        return P.Display(msg.cell_id, msg.kind, msg.data, msg.json, msg.binary, msg.metadata, msg.display_id,
                         msg.wait, seg.describe(layout, total))

    def end_cell(self, cell: int) -> None:
        """The main thread finished ``cell``: show its open figures, then say how many displays were dropped."""
        try:
            self.flush_figures(cell=cell)
        except Exception as e:  # noqa: BLE001 - a figure that cannot be drawn must not break the cell's end
            sys.stderr.write(f"display: the cell's figures could not be shown: {type(e).__name__}: {e}\n")
        with self._lock:
            dropped = self._dropped.pop(cell, 0)
            self._count.pop(cell, None)
            self.figures_shown.clear()
        if dropped:
            note = (f"{dropped} more displays of this cell were not shown (at most {MAX_PER_CELL} per rank and "
                    "cell); update one display instead: h = display(x, display_id=True); h.update(y)")
            self.send_bundle(cell, "display", {"text/plain": note}, {})

    def flush_figures(self, cell: int | None = None) -> None:
        """Show every open pyplot figure as a PNG (once: not those ``display()`` showed in this cell), then close
        them all (``plt.show()``, and the end of a cell)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        import matplotlib

        if matplotlib.get_backend() != BACKEND:  # the rank's environment chose another backend (MPLBACKEND)
            return
        nums = pyplot.get_fignums()
        if not nums:
            return
        for num in nums:
            fig = pyplot.figure(num)  # an open figure: made current, not created
            if id(fig) not in self.figures_shown:
                self._publish("display", fig, False, None, None, None, "", cell)
        pyplot.close("all")

    def cell_value(self, value: Any) -> Any:
        """A cell's last value as it goes back to the notebook: a matplotlib figure becomes a ``FigureImage``."""
        if not _is_figure(value):
            return value
        notes: list[str] = []
        try:
            png = _figure_png(value)
        except Exception as e:  # noqa: BLE001
            png = b""
            notes.append(f"{type(e).__name__}: {e}")
        text = _safe_repr(value, notes)
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.close(value)
        return FigureImage(png, text) if png else text


class DisplayHandle:
    """What ``display(obj, display_id=...)`` returns on a rank (as IPython's DisplayHandle)."""

    def __init__(self, publisher: Publisher, display_id: str) -> None:
        self.publisher, self.display_id = publisher, display_id

    def display(self, obj: Any, **kwargs: Any) -> None:
        self.publisher.display(obj, display_id=self.display_id, **kwargs)

    def update(self, obj: Any, **kwargs: Any) -> None:
        self.publisher.update_display(obj, display_id=self.display_id, **kwargs)

    def __repr__(self) -> str:
        return f"<DisplayHandle display_id={self.display_id}>"


# ---- the rank's publisher, and the functions cells call

_publisher: Publisher | None = None


def display(*objs: Any, **kwargs: Any) -> Any:
    """Show ``objs`` in the notebook cell (see ``Publisher.display``); prints them outside a rank."""
    if _publisher is None:
        print(*objs)
        return None
    return _publisher.display(*objs, **kwargs)


def update_display(obj: Any, *, display_id: str, **kwargs: Any) -> None:
    """See ``Publisher.update_display``."""
    if _publisher is not None:
        _publisher.update_display(obj, display_id=display_id, **kwargs)


def clear_output(wait: bool = False) -> None:
    """See ``Publisher.clear_output``."""
    if _publisher is not None:
        _publisher.clear_output(wait)


def publisher() -> Publisher | None:
    """This process's publisher (None outside a rank)."""
    return _publisher


def install(pub: Publisher, namespace: dict | None = None) -> None:
    """Make ``pub`` this rank's publisher: the functions above, IPython's display functions once a cell imports
    them, and matplotlib's default backend (unless the rank's environment chose another)."""
    global _publisher
    _publisher = pub
    if namespace is not None:
        for name, fn in (("display", display), ("update_display", update_display), ("clear_output", clear_output)):
            namespace.setdefault(name, fn)
    from .hooks import after_import

    # The backend is chosen when matplotlib is imported, not through MPLBACKEND: the rank's environment stays what
    # torchrun would give it (docs/torchrun.md), and a backend the user's environment names wins.
    if os.environ.get("MPLBACKEND", "") in ("", "module://matplotlib_inline.backend_inline"):
        after_import("matplotlib", _use_rank_backend)
    after_import("IPython.core.display_functions", _patch_ipython)


def _use_rank_backend(matplotlib: Any) -> None:
    """matplotlib was just imported on this rank: draw with the rank's backend (figures become displays)."""
    matplotlib.use(BACKEND)


def _patch_ipython(module: Any) -> None:
    """IPython's display functions print text without a shell; on a rank they publish (see install)."""
    module.display, module.update_display, module.clear_output = display, update_display, clear_output
