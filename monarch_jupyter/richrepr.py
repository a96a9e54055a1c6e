"""The HTML view of per-rank values (``RankMap._repr_html_``): each rank's rich repr, or one when all are equal.

Only values with a rich repr (``_repr_html_``, ``_repr_png_``, ``_repr_svg_``, ``_repr_jpeg_``, ``_repr_markdown_``
or ``_repr_latex_``: DataFrames, images, figures that came back from ranks) get an HTML view; a mapping of plain
values (numbers, tensors, strings) keeps only its text, which nbval compares in saved notebooks. Its
``text/plain`` never changes: it comes from ``RankMap._repr_pretty_``.

The rows are a CSS grid of ``div`` elements, not a ``<table>``: JupyterLab's rendered-HTML rules for tables (right
alignment, zebra stripes, centring) would restyle a table around the values, and a DataFrame among them would sit
in a striped row. The values' own HTML (a DataFrame's table) is shown as JupyterLab shows it anywhere.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping
from typing import Any

__all__ = ["rankmap_html", "has_rich_repr", "values_equal", "MAX_RANKS_SHOWN"]

MAX_RANKS_SHOWN = 64  # ranks shown in the HTML view; the rest are counted ("... and 12 more ranks")

_RICH = ("_repr_html_", "_repr_png_", "_repr_svg_", "_repr_jpeg_", "_repr_markdown_", "_repr_latex_")


def has_rich_repr(value: Any) -> bool:
    """True when ``value`` has one of IPython's rich repr methods (a class attribute, not a dynamic one)."""
    return any(getattr(type(value), name, None) is not None for name in _RICH)


def values_equal(a: Any, b: Any) -> bool:
    """Equality that never raises: tensors and arrays by content, DataFrames by ``equals``, else ``==``."""
    if a is b:
        return True
    ta, tb = type(a), type(b)
    # Classes defined in cells come back by value, one class object per rank: same name, same module.
    if ta is not tb and (ta.__qualname__, ta.__module__) != (tb.__qualname__, tb.__module__):
        return False
    try:
        if hasattr(a, "equals") and callable(a.equals):  # pandas
            return bool(a.equals(b))
        torch = _module("torch")
        if torch is not None and isinstance(a, torch.Tensor):
            return bool(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
        np = _module("numpy")
        if np is not None and isinstance(a, np.ndarray):
            return bool(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b))
        result = a == b
        return result if isinstance(result, bool) else False
    except Exception:  # noqa: BLE001 - values whose comparison fails are shown apart
        return False


def _module(name: str) -> Any:
    import sys

    return sys.modules.get(name)


def _value_html(value: Any) -> str:
    """The richest HTML of one value (escaped text where it has none); a repr that raises is named, not raised."""
    for name, wrap in (("_repr_html_", None), ("_repr_svg_", None), ("_repr_png_", "image/png"),
                       ("_repr_jpeg_", "image/jpeg"), ("_repr_markdown_", "md"), ("_repr_latex_", "md")):
        method = getattr(type(value), name, None)
        if method is None:
            continue
        try:
            got = getattr(value, name)()
        except Exception as e:  # noqa: BLE001
            return f"<pre>{html.escape(f'{name} raised {type(e).__name__}: {e}')}</pre>"
        if isinstance(got, tuple):
            got = got[0]
        if got is None:
            continue
        if wrap is None:
            return str(got)
        if wrap == "md":
            return f"<pre>{html.escape(str(got))}</pre>"
        data = got if isinstance(got, str) else base64.b64encode(bytes(got)).decode("ascii")
        return f'<img src="data:{wrap};base64,{data}"/>'
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001
        text = f"<{type(value).__name__} (repr raised {type(e).__name__})>"
    return f"<pre>{html.escape(text)}</pre>"


def rankmap_html(values: Mapping[int, Any], ranks_label: str) -> str | None:
    """HTML for per-rank ``values`` (rank -> value), or None when no value has a rich repr (text only then).

    ``ranks_label`` names the ranks ("ranks 0-3"). All equal: one value under "all N ranks equal (ranks 0-3)";
    else one row per rank, its name and its value's HTML (at most ``MAX_RANKS_SHOWN``).
    """
    items = list(values.items())
    if not items or not any(has_rich_repr(v) for _, v in items):
        return None
    first = items[0][1]
    note = "font-size:smaller;color:var(--jp-ui-font-color2,#666);margin:2px 0"
    if len(items) > 1 and all(values_equal(first, v) for _, v in items[1:]):
        return (f'<div class="mj-rankmap" data-equal="true"><div style="{note}">all {len(items)} ranks equal '
                f"({html.escape(ranks_label)})</div>{_value_html(first)}</div>")
    rows = []
    for rank, value in items[:MAX_RANKS_SHOWN]:
        rows.append(f'<div class="mj-rankmap-rank" data-rank="{rank}" style="{_NAME}">rank {rank}</div>'
                    f'<div class="mj-rankmap-value" data-rank="{rank}" style="min-width:0;overflow-x:auto">'
                    f"{_value_html(value)}</div>")
    more = len(items) - MAX_RANKS_SHOWN
    tail = f'<div style="{note}">... and {more} more ranks (index the mapping)</div>' if more > 0 else ""
    return f'<div class="mj-rankmap" data-equal="false"><div style="{_GRID}">{"".join(rows)}</div>{tail}</div>'


_GRID = "display:grid;grid-template-columns:max-content minmax(0,1fr);gap:6px 12px;align-items:start"
_NAME = ("font-weight:600;white-space:nowrap;padding-top:2px;color:var(--jp-ui-font-color1,inherit);"
         "font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,12px)")
