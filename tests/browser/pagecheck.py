"""What a person sees in a cell's output, read from the DOM of JupyterLab (tests/browser): visible text, visible
images, elements that overflow their cell, and the contrast of text against what is behind it.

Each check is one ``Locator.evaluate`` of a small script on the cell's output area (``.jp-OutputArea``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["visible_text", "count_visible", "visible_images", "overflowing", "contrast", "precedes"]

# innerText leaves out what is not rendered (display:none, a closed <details>, a tab that is not current).
_JS_TEXT = "(area) => area.innerText"

_JS_IMAGES = """(area) => Array.from(area.querySelectorAll('img'))
  .filter(i => i.getClientRects().length > 0 && getComputedStyle(i).visibility !== 'hidden')
  .map(i => (i.getAttribute('src') || '').slice(0, 120))"""

# Every rendered element of the output area must end within the area's right edge (1 px of rounding), unless a box
# between it and the area scrolls (overflow-x auto or scroll) or clips it on purpose (an ellipsis: overflow hidden).
_JS_OVERFLOW = """(area) => {
  const out = area;
  const right = out.getBoundingClientRect().right + 1;
  const bad = [];
  const held = (el) => {
    for (let p = el.parentElement; p && p !== out; p = p.parentElement) {
      const ox = getComputedStyle(p).overflowX;
      if (ox === 'auto' || ox === 'scroll' || ox === 'hidden' || ox === 'clip') return true;
    }
    return false;
  };
  for (const el of out.querySelectorAll('*')) {
    const rects = el.getClientRects();
    if (!rects.length) continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= right) continue;
    if (held(el)) continue;
    bad.push(`${el.tagName.toLowerCase()}.${(el.className && el.className.baseVal !== undefined ?
      el.className.baseVal : el.className) || ''} right=${Math.round(r.right)} > ${Math.round(right)}`);
  }
  for (const el of out.querySelectorAll('.jp-OutputArea-output')) {
    if (el.scrollWidth > el.clientWidth + 1) bad.push(`output ${el.scrollWidth} > ${el.clientWidth}`);
  }
  return bad.slice(0, 20);
}"""

# WCAG contrast of each element's text colour (SVG: fill) against the first opaque background behind it.
_JS_CONTRAST = """([area, css]) => {
  const parse = (c) => {
    const m = c.match(/rgba?\\(([^)]+)\\)/);
    if (!m) return null;
    const v = m[1].split(/[ ,/]+/).filter(Boolean).map(Number);
    return {r: v[0], g: v[1], b: v[2], a: v.length > 3 ? v[3] : 1};
  };
  const lum = (c) => {
    const f = (x) => { x /= 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(c.r) + 0.7152 * f(c.g) + 0.0722 * f(c.b);
  };
  const background = (el) => {
    for (let p = el; p; p = p.parentElement) {
      const c = parse(getComputedStyle(p).backgroundColor);
      if (c && c.a > 0.5) return c;
    }
    return parse(getComputedStyle(document.body).backgroundColor) || {r: 255, g: 255, b: 255, a: 1};
  };
  return Array.from(area.querySelectorAll(css)).filter(e => e.getClientRects().length).map(e => {
    const s = getComputedStyle(e);
    const fg = parse(e instanceof SVGElement ? s.fill : s.color) || parse(s.color);
    const bg = background(e);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    return {text: e.textContent.trim().slice(0, 40), ratio: (a + 0.05) / (b + 0.05), fg: s.fill,
            bg: JSON.stringify(bg)};
  });
}"""

# True when the first element matching `first` comes before (in document order) every match of `then`.
_JS_PRECEDES = """([area, first, then]) => {
  const a = area.querySelector(first);
  const bs = Array.from(area.querySelectorAll(then));
  if (!a || !bs.length) return null;
  return bs.every(b => !!(a.compareDocumentPosition(b) & Node.DOCUMENT_POSITION_FOLLOWING));
}"""


def visible_text(area: Any) -> str:
    """The text a person sees in the output area (``area``: a Playwright Locator)."""
    return str(area.evaluate(_JS_TEXT))


def count_visible(area: Any, text: str, *, besides: str = ".mj-table") -> int:
    """How many times ``text`` is seen in the output area, besides in elements matching ``besides`` (the dashboard's
    table: its "last output" column repeats a rank's latest line on purpose)."""
    summary = "".join(area.locator(besides).all_inner_texts()) if besides else ""
    return visible_text(area).count(text) - summary.count(text)


def visible_images(area: Any) -> list[str]:
    """The start of the ``src`` of every image a person sees in the output area."""
    return list(area.evaluate(_JS_IMAGES))


def overflowing(area: Any) -> list[str]:
    """Elements that stick out of the output area's right edge outside any scroll box (empty: none)."""
    return list(area.evaluate(_JS_OVERFLOW))


def contrast(area: Any, css: str) -> list[dict]:
    """The WCAG contrast ratio of every element matching ``css`` against what is behind it."""
    return list(area.page.evaluate(_JS_CONTRAST, [area.element_handle(), css]))


def precedes(area: Any, first: str, then: str) -> bool | None:
    """The first match of ``first`` comes before every match of ``then`` (None: one of them is missing)."""
    return area.page.evaluate(_JS_PRECEDES, [area.element_handle(), first, then])
