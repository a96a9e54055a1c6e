"""Per-rank views of a mesh: a live dashboard in widget frontends, compact text elsewhere.

Every view listens to Mesh events only (through one ``MeshMonitor`` per mesh). The magics create and show
views; the same works from Python::

    from monarch_jupyter.widgets import cell_view
    view = cell_view(mesh)             # before submitting: follows the next cell
    with view.capture():               # optional: the cell's output shows in the view, not beside it
        result = mesh.run(code)        # (block=False too: the view keeps updating on its own; output that a
                                       # wait outside this block writes goes beside the view)
    view.finish()                      # optional: render the final state now

``mode`` is "auto" (a dashboard in a Jupyter kernel with ipywidgets, text in a terminal or script), "widget",
"text" or "off".
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .model import MeshMonitor, monitor_for
from .text import StatusText, TextLiveView
from .view import LiveView

log = logging.getLogger(__name__)

__all__ = ["status_view", "cell_view", "choose_mode", "monitor_for", "MeshMonitor", "StatusText", "LiveView",
           "TextLiveView", "MODES", "frontend_watches"]

MODES = ("auto", "widget", "text", "off")
LIVE_STATUS_VIEWS = 3  # `%mesh status` dashboards of one mesh that keep updating
LIVE_CELL_VIEWS = 20  # finished cells of this kernel whose live widget stays (rank tabs); older ones turn static


def frontend_watches() -> bool:
    """False when the running cell was sent by a kernel client that runs the notebook unattended: its request does
    not allow stdin (nbval, nbconvert and papermill run notebooks so; JupyterLab, Notebook 7 and VS Code allow it).
    True otherwise, also outside a kernel (a script that asks for a widget view gets a live one)."""
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        if kernel is None:
            return True
        return bool(kernel.get_parent("shell").get("content", {}).get("allow_stdin", True))
    except Exception:  # noqa: BLE001 - a kernel without get_parent (not ipykernel): assume a person watches
        return True


def _in_widget_frontend() -> bool:
    """True inside a Jupyter kernel (ipykernel), where frontends render ipywidgets."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def choose_mode(mode: str = "auto") -> str:
    """Resolve ``mode`` to "widget", "text" or "off".

    Raises
    ------
    ValueError
        ``mode`` is not one of ``MODES``.
    """
    if mode not in MODES:
        raise ValueError(f"live view mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode != "auto":
        return mode
    if _in_widget_frontend():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            log.info("ipywidgets is not installed; live views print text")
            return "text"
        return "widget"
    return "text"


def _display(widget: Any) -> None:
    from IPython.display import display

    bundle = widget._repr_mimebundle_()
    if not _publish_unflushed(bundle):
        display(bundle, raw=True)  # the bundle as is: no formatter pass


def publish_bundle(bundle: dict, display_id: str, update: bool) -> None:
    """Publish ``bundle`` as display_data (``update``: update_display_data) under ``display_id``, in the calling
    context (a view calls it inside the context of the cell it belongs to)."""
    if _publish_unflushed(bundle, display_id, update):
        return
    from IPython.display import display, update_display

    if update:
        update_display(bundle, display_id=display_id, raw=True)
    else:
        display(bundle, display_id=display_id, raw=True)


def _publish_unflushed(bundle: dict, display_id: str = "", update: bool = False) -> bool:
    """Publish ``bundle`` as display_data the way ipykernel's ZMQDisplayPublisher.publish does, minus its flush of
    sys.stdout and sys.stderr when neither holds anything: each flush is a round trip to ipykernel's IOPub thread
    (about 0.3 ms apiece on a busy 2-core machine, half of what a cell's dashboard used to cost), and a cell's
    dashboard is shown before the cell has printed anything. Returns False, having sent nothing, where that does
    not apply (not ipykernel, output waiting to be flushed, or display history kept): then display() does it all.
    """
    try:
        from IPython import get_ipython

        pub = get_ipython().display_pub
        pending = [getattr(s, "_flush_pending", True) for s in (sys.stdout, sys.stderr)]
        session, socket, hooks = pub.session, pub.pub_socket, pub._hooks
        if any(pending) or session is None or socket is None or getattr(pub, "store_display_history", False):
            return False
        transient = {"display_id": display_id} if display_id else {}
        msg = session.msg("update_display_data" if update else "display_data",
                          {"data": bundle, "metadata": {}, "transient": transient}, parent=pub.parent_header)
        for hook in list(hooks):  # e.g. an ipywidgets Output capturing this display
            msg = hook(msg)
            if msg is None:
                return True
        session.send(socket, msg, ident=pub.topic)
        return True
    except Exception:  # noqa: BLE001 - anything unexpected: the plain way
        return False


def cell_view(mesh: Any, ranks: list[int] | None = None, *, mode: str = "auto", fold_threshold: int = 16,
              title: str = "mesh cell", defer: float | None = None, watched: bool | None = None,
              lines_kept: int | None = None) -> LiveView | None:
    """Show a live view of the next cell submitted to ``mesh`` (call it just before ``Mesh.run``).

    In a widget frontend the view is one display: the per-rank table, charts and, for a cell submitted inside
    ``view.capture()``, the cell's output (otherwise the output streams beside it as usual).

    Parameters
    ----------
    ranks:
        The ranks the cell will run on (shown until the cell is submitted; default: all).
    mode:
        See ``choose_mode``; "off" returns None.
    fold_threshold:
        Past this many ranks the dashboard folds into a per-state summary plus stragglers and failed ranks.
    title:
        The dashboard's title ("mesh cell (auto mode)" for cells that auto mode sent to the mesh).
    defer:
        Seconds the cell runs before the live widget replaces the view's placeholder (None: ``celldash.DEFER``; 0:
        the widget at once). A cell that ends sooner shows its final state as static HTML, without a widget.
    watched:
        A person watches the frontend (None: ``frontend_watches()``): a placeholder shows at once and the live widget
        after ``defer`` seconds. False (nbval, nbconvert): one display of the final state at the cell's end, or,
        with ``defer`` 0 (an ``--async`` cell), a placeholder at once that the final state replaces.
    lines_kept:
        Lines of output the view keeps (None: ``record.LINES_KEPT``, the option ``output_lines``'s default); past
        them the oldest go and the view says how many.

    Returns
    -------
    The view (already shown and updating), or None for mode "off". Call ``finish()`` after a blocking cell to
    render its final state at once; a view of a non-blocking cell finishes by itself when the cell is done.

    Raises
    ------
    ValueError
        ``mode`` is not one of ``MODES``.
    """
    mode = choose_mode(mode)
    if mode == "off":
        return None
    monitor = monitor_for(mesh)
    chosen = list(ranks) if ranks is not None else list(range(mesh.nproc))
    if mode == "text":
        return TextLiveView(monitor, chosen, follow_cell=True).start()
    import contextvars

    from .celldash import DEFER, CellDashboardView, plain_header
    from .record import LINES_KEPT

    ctx = contextvars.copy_context()  # the cell's: later updates come from other threads

    def publish(bundle: dict, display_id: str, update: bool) -> None:
        ctx.run(publish_bundle, bundle, display_id, update)

    watched = frontend_watches() if watched is None else watched
    defer = DEFER if defer is None else defer
    view = CellDashboardView(monitor, chosen, title=title, fold_threshold=fold_threshold,
                             plain=plain_header(title, chosen), publish=publish, defer=defer, live=watched,
                             placeholder=watched or defer <= 0,
                             lines_kept=LINES_KEPT if lines_kept is None else lines_kept)
    view.show()
    view.start()
    _retire_cell_views(view)
    return view


_CELL_VIEWS: list[Any] = []  # cell views of this kernel that may hold a live widget, of every mesh (oldest first)


def _retire_cell_views(view: Any) -> None:
    """Keep the live widgets of the last ``LIVE_CELL_VIEWS`` cells of this kernel that made one, whatever mesh ran
    them (a stopped mesh's too); older finished cells show their final state as static HTML instead
    (``CellDashboardView.retire``): each live widget holds 6 widget models (a comm each, in the kernel and in the
    browser), which a session of hundreds of cells would otherwise keep. Called from the thread that runs cells."""
    kept = [v for v in _CELL_VIEWS if not v.retired and (v.widget_made is not None or not v.final)]
    made = [v for v in kept if v.widget_made is not None]
    for old in made[: max(0, len(made) - LIVE_CELL_VIEWS + 1)]:  # room for ``view``'s own (21 were kept: helper-63)
        if old.retire():
            kept.remove(old)
    _CELL_VIEWS[:] = [*kept, view]


def status_view(mesh: Any, *, mode: str = "auto", fold_threshold: int = 16, note: str = "") -> Any:
    """What ``%mesh status`` shows: a live dashboard of every rank (until the mesh stops), or ``StatusText``.
    ``note`` (e.g. "auto mode: on") is shown under the header.

    Returns the object to display (the magic returns it, so it becomes the cell's output).
    """
    mode = choose_mode(mode)
    monitor = monitor_for(mesh)
    if mode != "widget":
        return StatusText(mesh, monitor, note=note)
    from .dashboard import DashboardView

    view = DashboardView(monitor, None, follow_cell=False, title=f"mesh · {note}" if note else "mesh",
                         fold_threshold=fold_threshold)
    view.start()
    assert view.widget is not None
    # A notebook may ask for the status many times; the latest few stay live, older ones keep their last state.
    live = [v for v in monitor.status_views if not v.final]
    for old in live[: max(0, len(live) - LIVE_STATUS_VIEWS + 1)]:
        old.freeze()
    monitor.status_views = [v for v in live if not v.final] + [view]
    return view.widget
