"""Live reports from rank code to the notebook: ``progress()`` and the tqdm hook.

In a cell that runs on the ranks::

    from monarch_worker import progress
    for step in range(steps):
        loss = train_step()
        progress(step + 1, steps, desc="train", loss=loss)

drives that rank's progress bar in the notebook's live view (``%%mesh`` dashboard, ``%mesh status``). A tqdm bar
does the same without any change to the code: ``tqdm``, ``tqdm.auto`` and ``trange`` bars in a rank send their
count, total, description and postfix along with their ordinary text output (which still reaches the cell as
the rank's stderr). Nested bars report the innermost open bar, prefixed with the outer bars' counts. A bar made
with ``disable=True`` (e.g. ``disable=rank != 0``) reports nothing; call ``progress()`` on those ranks.

Reports are throttled on the rank: at most one ``Progress`` message per ``MIN_INTERVAL`` seconds, so a tight loop
costs a time check per call. The first report of a bar and the last of a loop go at once; a report held back goes
``MIN_INTERVAL`` after the one before it (from a timer thread), or at the end of the cell, whichever is first, so
the view never shows a stale count or postfix while a long step runs (tqdm's ``set_postfix`` redraws the bar right
after the step count: that second report is the one a step of many seconds would otherwise hide). Each report
carries a sequence number; the controller keeps the newest when two reach it out of order. Outside a rank (no mesh
runtime in this process) ``progress()`` does nothing.

This module imports neither tqdm nor torch: tqdm is patched when (and if) the rank imports it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import protocol as P
from .hooks import after_import

log = logging.getLogger(__name__)

__all__ = ["progress", "install", "flush", "MIN_INTERVAL"]

MIN_INTERVAL = 0.1  # seconds between two Progress messages of one rank (the last one is never dropped)

_send: Callable[[P.Message], None] | None = None  # set by install() in a rank
def _no_cell() -> int:
    return -1


_current_cell: Callable[[], int] = _no_cell
_lock = threading.Lock()
_last_sent = 0.0
_pending: P.Progress | None = None
_seq = 0  # sequence number of the last report made (Progress.seq)
_timer: threading.Timer | None = None  # sends the held-back report when its interval is over


def install(send: Callable[[P.Message], None], current_cell: Callable[[], int]) -> None:
    """Route ``progress()`` and tqdm bars of this process to ``send`` (called by the rank runtime).

    ``send`` queues a message for the controller from any thread; ``current_cell`` returns the id of the cell
    the main thread runs (-1 when idle).
    """
    global _send, _current_cell
    _send, _current_cell = send, current_cell
    _install_tqdm_hook()


def progress(n: float, total: float | None = None, *, desc: str = "", **metrics: Any) -> None:
    """Report that this rank has done ``n`` of ``total`` steps (``total`` None: unknown).

    Parameters
    ----------
    n:
        Steps done so far (int or float, e.g. samples or bytes).
    total:
        Steps in all, or None when unknown (the bar then shows the count only).
    desc:
        Short label of the loop ("train", "epoch 2").
    **metrics:
        Values shown after the count, like tqdm's postfix: ``progress(i, n, loss=0.25)`` shows ``loss=0.25``.
        Floats are shown with 4 significant digits. A 0-d tensor shows its value (``.item()`` is called
        here, which synchronizes a CUDA tensor: pass a float where that matters).

    Raises
    ------
    TypeError
        ``n`` or ``total`` is not a number.
    """
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        raise TypeError(f"progress(n, total): n must be a number of steps, got {type(n).__name__}")
    if total is not None and (not isinstance(total, (int, float)) or isinstance(total, bool)):
        raise TypeError(f"progress(n, total): total must be a number of steps or None, got {type(total).__name__}")
    postfix = ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
    numbers = tuple((str(k), x) for k, v in metrics.items() if (x := as_number(v)) is not None)
    _report(float(n), None if total is None else float(total), str(desc), postfix,
            final=total is not None and n >= total, metrics=numbers)


def flush() -> None:
    """Send the report held back by throttling, if any (the runtime calls this at the end of each cell)."""
    global _pending, _last_sent
    with _lock:
        msg, _pending = _pending, None
        if msg is not None:
            _last_sent = time.monotonic()
    if msg is not None and _send is not None:
        _send(msg)


def _fmt(value: Any) -> str:
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a number (a 0-d tensor's ``.item()``), else None."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _report(n: float, total: float | None, desc: str, postfix: str, *, final: bool = False,
            first: bool = False, metrics: tuple = ()) -> None:
    global _pending, _last_sent, _seq, _timer
    if _send is None:
        return
    now = time.monotonic()
    with _lock:
        _seq += 1
        msg = P.Progress(cell_id=_current_cell(), n=n, total=total, desc=desc, postfix=postfix, seq=_seq,
                         metrics=metrics)
        if not (final or first) and now - _last_sent < MIN_INTERVAL:
            _pending = msg
            if _timer is None or not _timer.is_alive():  # not alive: an interrupt landed before it started
                _timer = threading.Timer(MIN_INTERVAL - (now - _last_sent), _send_held)
                _timer.name, _timer.daemon = "monarch-progress", True
                _timer.start()
            return
        _pending = None
        _last_sent = now
    _send(msg)


def _send_held() -> None:
    """Timer thread: the interval after the last report is over; send the report held back since, if any."""
    global _timer
    with _lock:
        _timer = None
    flush()


# --------------------------------------------------------------------------------------------------------------
# tqdm: patch tqdm.std.tqdm (the base of tqdm.auto, trange and tqdm.asyncio) when the rank imports it.

_open_bars: list[weakref.ref] = []  # open bars, outermost first
_bars_lock = threading.Lock()
_hook_installed = False


def _bar_report(bar: Any, closing: bool = False) -> None:
    try:
        fmt = bar.format_dict
        n, total = float(fmt.get("n") or 0), fmt.get("total")
        desc = str(fmt.get("prefix") or "").rstrip(": ")
        postfix = str(fmt.get("postfix") or "").lstrip(", ")
    except Exception:  # noqa: BLE001 - a half-built or exotic bar must never break the user's loop
        return
    with _bars_lock:
        alive = [r for r in _open_bars if r() is not None and r() is not bar]
        new = not closing and all(r() is not bar for r in _open_bars)
        _open_bars[:] = alive if closing else [*alive, weakref.ref(bar)]
        outer = [r() for r in alive]
    if closing and outer:
        return  # an inner bar ended; the outer bar reports on its next update
    prefix = " · ".join(_bar_brief(b) for b in outer if b is not None)
    desc = f"{prefix} · {desc}" if prefix and desc else (prefix or desc)
    total_f = None if total is None else float(total)
    _report(n, total_f, desc, postfix, final=closing or (total_f is not None and n >= total_f), first=new)


def _bar_brief(bar: Any) -> str:
    try:
        fmt = bar.format_dict
        label = str(fmt.get("prefix") or "").rstrip(": ")
        count = f"{fmt.get('n', 0):g}" + (f"/{fmt['total']:g}" if fmt.get("total") is not None else "")
        return f"{label} {count}".strip()
    except Exception:  # noqa: BLE001
        return ""


def _patch_tqdm(std: ModuleType) -> None:
    cls = getattr(std, "tqdm", None)
    if cls is None or getattr(cls, "_monarch_patched", False):
        return
    display, close = cls.display, cls.close

    def patched_display(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = display(self, *args, **kwargs)
        if not getattr(self, "_monarch_closing", False):
            _bar_report(self)
        return result

    def patched_close(self: Any) -> Any:
        was_open = not getattr(self, "disable", True)
        self._monarch_closing = True
        try:
            return close(self)
        finally:
            if was_open:
                _bar_report(self, closing=True)

    cls.display, cls.close = patched_display, patched_close
    cls._monarch_patched = True


def _install_tqdm_hook() -> None:
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    after_import("tqdm.std", _patch_tqdm)  # at once if tqdm is imported already
